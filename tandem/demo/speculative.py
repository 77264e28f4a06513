"""`tandem demo` section: a copy-heavy task with and without speculation (CPU drafting), outputs identical."""

from __future__ import annotations

from tandem.bench.common import drive
from tandem.demo.common import Rows, chat_prompt, section, speed
from tandem.engine.engine import LLMEngine
from tandem.params import SamplingParams
from tandem.spec_decode.config import SpeculativeConfig

CODE = '''def moving_average(values, window):
    """Return the moving averages of `values` over `window` items."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
'''


def tour_speculative(engine: LLMEngine, rows: Rows, quick: bool) -> None:
    section("Speculative decoding: drafts from the CPU (suffix decoding), verified by the model, lossless")
    ask = "Rewrite this function exactly, but rename `values` to `data`. Output only the code.\n\n" + CODE
    prompt = chat_prompt(engine, ask)
    params = SamplingParams(temperature=0.0, max_tokens=96 if quick else 160)
    texts: dict[str, str] = {}

    def keep(name: str):  # type: ignore[no-untyped-def]
        return lambda o: texts.__setitem__(name, o.outputs[0].text)

    engine.set_speculation(None)
    drive(engine, [prompt], SamplingParams(max_tokens=1), 1, "prefill")  # both runs find the prompt cached
    base = drive(engine, [prompt], params, 1, "plain", on_output=keep("plain"))
    engine.set_speculation(SpeculativeConfig(method="suffix", num_speculative_tokens=8, adaptive=True))
    fast = drive(engine, [prompt], params, 1, "speculative", on_output=keep("speculative"))
    st = engine.get_stats()
    engine.set_speculation(None)
    print(texts["speculative"])
    same = texts["speculative"] == texts["plain"]
    print(f"  identical to the output without speculation: {same}; acceptance {st['spec_acceptance_rate']:.0%}, "
          f"{st['spec_mean_accepted_length']:.2f} tokens per verification step; "
          f"speed-up {fast.tok_per_s / base.tok_per_s:.2f}x")
    if not same and engine.config.dtype != "float32":
        print("  (bf16: the verification forward's different shapes may round a near-tie differently; float32 is exact)")
    rows.append({"what": "copy task, 1 request, no speculation", **speed(base)})
    rows.append({"what": "copy task, suffix-decoding drafts", **speed(fast)})
