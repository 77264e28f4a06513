"""The engine's request-facing side on the CPU: token ids in, text out.

`detokenizer.IncrementalDetokenizer` turns output token ids into text deltas; `stop.StopChecker` decides when a
request ends (EOS, stop token ids, stop strings, max_tokens, max_model_len) and what text it keeps.
"""
