"""`tandem demo` section: JSON-schema extraction on the demo model, validated, and guided vs unguided speed."""

from __future__ import annotations

import json

import jsonschema

from tandem.bench.common import drive
from tandem.demo.common import Rows, chat_prompt, section, speed
from tandem.engine.engine import LLMEngine
from tandem.params import SamplingParams, StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "city": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "languages"],
    "additionalProperties": False,
}
TEXTS = [
    "Maria Lopez, 34, moved to Madrid last year; she speaks Spanish and English.",
    "Kenji Tanaka is a 51-year-old engineer from Osaka who speaks Japanese.",
    "Olu Adeyemi (28) lives in Lagos and speaks Yoruba, English and French.",
    "Anna Schmidt, aged 45, is from Berlin. She speaks German and Italian.",
]


def tour_structured(engine: LLMEngine, rows: Rows, quick: bool) -> None:
    section("Structured outputs: JSON schema, grammar masks filled on the CPU while the forward runs")
    prompts = [chat_prompt(engine, f"Extract the person as JSON. {t}") for t in TEXTS]
    guided = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=PERSON))
    engine.warm_up_grammars()
    outs: list[str] = []
    drive(engine, prompts, SamplingParams(max_tokens=1), len(prompts), "prefill")  # both runs find the prompts cached
    res = drive(engine, prompts, guided, len(prompts), "guided", on_output=lambda o: outs.append(o.outputs[0].text))
    for text in outs:
        jsonschema.validate(json.loads(text), PERSON)
        print(f"  valid: {text}")
    unguided = SamplingParams(temperature=0.0, max_tokens=max(8, res.output_tokens // len(prompts)), ignore_eos=True)
    base = drive(engine, prompts, unguided, len(prompts), "unguided")
    st = engine.get_stats()
    print(f"  {len(outs)}/{len(prompts)} outputs validate against the schema; forced tokens "
          f"{st.get('guided_forced_fraction', 0):.0%}; mask fill p50 {st.get('grammar_mask_fill_us_per_row_p50', 0):.0f} us/row; "
          f"grammar time the device waited for: {1e3 * st.get('grammar_exposed_s', 0):.1f} ms in all")
    rows.append({"what": f"JSON-schema guided, {len(prompts)} concurrent", **speed(res)})
    rows.append({"what": f"same prompts unguided, {len(prompts)} concurrent", **speed(base)})
