"""`tandem demo` section: a copy-heavy task with and without speculation (CPU drafting), outputs identical."""

from __future__ import annotations

import torch

from tandem.engine.engine import LLMEngine
from tandem.params import SamplingParams

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


def tour_speculative(engine: LLMEngine, rows: list[dict[str, object]], quick: bool) -> None:
    from tandem.bench.common import drive
    from tandem.demo import _section, _speed
    from tandem.engine.speculation import SpeculativeDecoder
    from tandem.spec.config import SpeculativeConfig, build_proposer

    _section("Speculative decoding: drafts from the CPU (suffix decoding), verified by the model, lossless")
    tok = engine.tokenizer
    ask = "Rewrite this function exactly, but rename `values` to `data`. Output only the code.\n\n" + CODE
    prompt = tok.apply_chat_template([{"role": "user", "content": ask}])
    params = SamplingParams(temperature=0.0, max_tokens=96 if quick else 160)
    texts: dict[str, str] = {}

    def keep(name: str):  # type: ignore[no-untyped-def]
        return lambda o: texts.__setitem__(name, o.outputs[0].text)

    engine.spec = None
    base = drive(engine, [prompt], params, 1, "plain", on_output=keep("plain"))
    cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=8, adaptive=True)
    engine.spec = SpeculativeDecoder(cfg, build_proposer(cfg, engine.vocab_size, tok), engine.max_model_len)
    fast = drive(engine, [prompt], params, 1, "spec", on_output=keep("spec"))
    st = engine.spec.stats
    engine.spec = None
    print(texts["spec"])
    same = texts["spec"] == texts["plain"]
    print(f"  identical to the output without speculation: {same}; acceptance {st.acceptance_rate:.0%}, "
          f"{st.mean_accepted_length:.2f} tokens per verification step; speed-up {fast.tok_per_s / base.tok_per_s:.2f}x")
    if not same and engine.runner.dtype != torch.float32:
        print("  (bf16: the verification forward's different shapes may round a near-tie differently; float32 is exact)")
    rows.append({"what": "copy task, 1 request, no speculation", **_speed(base)})
    rows.append({"what": "copy task, suffix-decoding drafts", **_speed(fast)})
