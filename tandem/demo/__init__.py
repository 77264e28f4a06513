"""`tandem demo` (what `make demo` runs): a short tour on the built-in demo model, ending with measured tok/s.

`tour.run_demo` runs the sections in order: `generation` (chat, seeded sampling, continuous batching),
`structured` (JSON schema), `speculative` (a copy task with CPU drafting); `common` holds the helpers they share.
"""
