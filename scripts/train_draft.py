"""Distil a small draft model for the demo model (SmolLM2-135M-Instruct) on the CPU, in a few minutes.

    python scripts/train_draft.py [--out DIR] [--layers 0,1,2,29] [--train-seconds 100]

1. Data: the target's own greedy answers to chat prompts from ../shared/data/prompts (MT-Bench, HumanEval, GSM8K),
   generated with tandem's engine (`tandem.LLM()` = the demo model). Held-out prompts are disjoint from training ones.
2. Draft: the target's (tied) embeddings, frozen, + its first four decoder layers + its final norm (`--layers`).
   Untrained, such a truncation agrees with the target on only ~4% of tokens (keeping late layers instead is worse:
   they expect mid-network features), so the distillation below does the work.
3. Distillation: cross-entropy on the target's greedy tokens (= the argmax of the target's next-token distribution
   at every answer position, which is exactly what greedy verification accepts), for a fixed wall-clock budget.
4. Output: an HF folder (config.json, model.safetensors in bfloat16, the demo model's tokenizer files) at
   $TANDEM_HOME/models/smollm2-draft, which `DraftModelProposer` loads.
5. Acceptance against the target on the held-out prompts, before and after training:
   * per-token agreement: fraction of positions where the draft's argmax equals the target's next token;
   * K=4 speculative simulation with `DraftModelProposer` (its KV sync and rollback included): acceptance rate
     (accepted / drafted) and mean accepted drafts per step (0..4); tokens per step are that + 1.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

import tandem
from tandem.models.checkpoint import write_hf_folder
from tandem.models.demo import demo_model_path
from tandem.params import SamplingParams
from tandem.paths import tandem_home
from tandem.spec_decode.draft_model import DraftModelProposer
from tandem.spec_decode.proposer import DraftRequest

PROMPTS = Path(__file__).resolve().parents[1] / "../shared/data/prompts"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


@dataclass
class Example:
    """One chat prompt and the target's greedy answer, as token ids."""

    prompt: list[int]
    answer: list[int]


# ------------------------------------------------------------------------------------------------------ data


def load_questions(n_per_source: int, offset: int) -> list[str]:
    """`n_per_source` user messages from each of MT-Bench, HumanEval and GSM8K, starting at item `offset`."""
    mt = [json.loads(line)["turns"][0] for line in (PROMPTS / "mt_bench_question.jsonl").open()]
    with gzip.open(PROMPTS / "HumanEval.jsonl.gz", "rt") as f:
        code = [f"Complete this Python function.\n```python\n{json.loads(line)['prompt']}```" for line in f]
    math = [json.loads(line)["question"] for line in (PROMPTS / "gsm8k_test.jsonl").open()]
    return [q for source in (mt, code, math) for q in source[offset : offset + n_per_source]]


def generate_examples(llm: tandem.LLM, questions: list[str], max_tokens: int) -> list[Example]:
    """The target's greedy answers (temperature 0) to `questions`, rendered with its chat template."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=False)
    return [Example(list(o.prompt_token_ids or []), list(o.outputs[0].token_ids)) for o in outs]


# ----------------------------------------------------------------------------------------------------- model


def build_draft(target_dir: Path, layers: list[int]) -> LlamaForCausalLM:
    """A Llama with the target's embeddings, the chosen target layers (renumbered 0..L-1) and final norm."""
    hf_config = json.loads((target_dir / "config.json").read_text())
    hf_config["num_hidden_layers"] = len(layers)
    config = LlamaConfig(**{k: v for k, v in hf_config.items() if k not in ("architectures", "torch_dtype")})
    model = LlamaForCausalLM(config)
    rename = {f"model.layers.{src}.": f"model.layers.{dst}." for dst, src in enumerate(layers)}
    state: dict[str, torch.Tensor] = {}
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open handles have no __iter__
            if name.startswith("model.layers."):
                prefix = ".".join(name.split(".")[:3]) + "."
                if prefix in rename:
                    state[rename[prefix] + name[len(prefix) :]] = f.get_tensor(name).float()
            else:
                state[name] = f.get_tensor(name).float()
    missing, _ = model.load_state_dict(state, strict=False)
    assert all(m == "lm_head.weight" for m in missing), missing  # tied to embed_tokens
    model.tie_weights()
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen, and so is the tied lm_head
    return model


def answer_logits(
    model: LlamaForCausalLM,
    batch: list[Example],
    max_context: int,
    positions_per_example: int | None = None,
    rng: random.Random | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits [N, V] at the positions that predict answer tokens, and those tokens [N] (the labels).

    Prompts are cut to their last `max_context` tokens (cheaper; RoPE is relative, so the answer positions see the
    same nearby context). Sequences are right-padded; only answer positions are projected onto the vocabulary (the
    [N, 49152] projection dominates the cost), and with `positions_per_example` only a random subset of them.
    """
    seqs = [ex.prompt[-max_context:] + ex.answer for ex in batch]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    rows: list[int] = []
    cols: list[int] = []
    labels: list[int] = []
    for b, (s, ex) in enumerate(zip(seqs, batch, strict=True)):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
        start = len(s) - len(ex.answer)  # position of the first answer token
        chosen = range(start, len(s))
        if positions_per_example is not None and rng is not None and len(chosen) > positions_per_example:
            chosen = sorted(rng.sample(chosen, positions_per_example))  # type: ignore[assignment]
        for p in chosen:
            rows.append(b)
            cols.append(p - 1)  # position p - 1 predicts token p
            labels.append(s[p])
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, width, hidden]
    logits = model.lm_head(hidden[torch.tensor(rows), torch.tensor(cols)])  # [N, V]
    return logits, torch.tensor(labels)


def train(
    model: LlamaForCausalLM, data: list[Example], seconds: float, batch_size: int, lr: float, max_context: int,
    positions_per_example: int,
) -> int:
    """AdamW on cross-entropy to the target's tokens until `seconds` have passed; returns the steps taken."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    rng = random.Random(0)
    order: list[int] = []
    t0 = time.monotonic()
    step = 0
    while time.monotonic() - t0 < seconds:
        if len(order) < batch_size:
            order = list(range(len(data)))
            rng.shuffle(order)
        batch = [data[order.pop()] for _ in range(batch_size)]
        logits, labels = answer_logits(model, batch, max_context, positions_per_example, rng)
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 1:
            print(f"  step {step:3d}  loss {loss.item():.3f}  ({time.monotonic() - t0:.0f} s)", flush=True)
    model.eval()
    return step


@torch.no_grad()
def token_agreement(model: LlamaForCausalLM, data: list[Example], max_context: int) -> float:
    """Fraction of answer positions where the draft's argmax equals the target's (teacher-forced)."""
    hits = total = 0
    for i in range(0, len(data), 8):
        logits, labels = answer_logits(model, data[i : i + 8], max_context)
        hits += int((logits.argmax(-1) == labels).sum())
        total += labels.numel()
    return hits / max(total, 1)


def save_draft(model: LlamaForCausalLM, target_dir: Path, out: Path) -> None:
    """Write the draft as an HF folder: bfloat16 safetensors, config.json, the target's tokenizer files."""
    hf_config = json.loads((target_dir / "config.json").read_text())
    hf_config.update(num_hidden_layers=model.config.num_hidden_layers, torch_dtype="bfloat16")
    weights = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}

    def copy_tokenizer(folder: Path) -> None:
        for name in TOKENIZER_FILES:
            if (target_dir / name).is_file():
                shutil.copy(target_dir / name, folder / name)

    write_hf_folder(out, hf_config, weights, copy_tokenizer)


# ------------------------------------------------------------------------------------------------ acceptance


def simulate_acceptance(draft_dir: Path, target_dir: Path, data: list[Example], k: int) -> tuple[float, float]:
    """Greedy speculative decoding of each held-out answer with K=k drafts; (acceptance rate, mean accepted/step).

    The target's greedy answer is the ground truth: per step, the accepted drafts are the longest prefix matching
    the answer's next tokens, then the target adds one token (the bonus, or the correction).
    """
    proposer = DraftModelProposer(
        draft_dir, num_speculative_tokens=k, target_vocab_size=_vocab_size(target_dir), target_tokenizer=target_dir,
        in_process=True,
    )
    tokens = {str(i): list(ex.prompt) for i, ex in enumerate(data)}
    done = {str(i): 0 for i in range(len(data))}  # answer tokens emitted so far
    drafted = accepted = steps = 0
    with proposer:
        while True:
            live = [rid for rid, ex in zip(tokens, data, strict=True) if done[rid] < len(ex.answer)]
            if not live:
                break
            out = proposer.propose([DraftRequest(rid, tokens[rid], len(data[int(rid)].prompt), k) for rid in live])
            for rid in live:
                rest = data[int(rid)].answer[done[rid] :]
                drafts = out[rid].token_ids
                n = 0
                while n < min(len(drafts), len(rest) - 1) and drafts[n] == rest[n]:
                    n += 1
                proposer.on_verified(rid, drafts[:n], len(drafts))
                tokens[rid].extend(rest[: n + 1])
                done[rid] += n + 1
                drafted += len(drafts)
                accepted += n
                steps += 1
    return accepted / max(drafted, 1), accepted / max(steps, 1)


def _vocab_size(target_dir: Path) -> int:
    return int(json.loads((target_dir / "config.json").read_text())["vocab_size"])


# ------------------------------------------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: $TANDEM_HOME/models/smollm2-draft)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    ap.add_argument("--layers", default="0,1,2,3", help="target layers the draft keeps, in order")
    ap.add_argument("--train-prompts", type=int, default=16, help="training prompts per source (3 sources)")
    ap.add_argument("--eval-prompts", type=int, default=4, help="held-out prompts per source")
    ap.add_argument("--max-tokens", type=int, default=96, help="answer length generated by the target")
    ap.add_argument("--max-context", type=int, default=160, help="prompt tokens kept per training example")
    ap.add_argument("--train-seconds", type=float, default=150.0, help="wall-clock training budget")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--positions", type=int, default=32, help="answer positions trained per example and step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--k", type=int, default=4, help="drafts per step for the acceptance simulation")
    args = ap.parse_args()

    out: Path = args.out or tandem_home() / "models" / "smollm2-draft"
    if out.exists() and any(out.iterdir()):
        if not args.overwrite:
            print(f"{out} exists; pass --overwrite to replace it or --out to write elsewhere", file=sys.stderr)
            return 2
        shutil.rmtree(out)
    torch.manual_seed(0)
    layers = [int(x) for x in args.layers.split(",")]
    t_start = time.monotonic()

    print("1. target generations with tandem.LLM() (demo model)", flush=True)
    target_dir = demo_model_path()
    llm = tandem.LLM(progress=False, kv_cache_memory=512 * 2**20, max_num_seqs=64)  # small KV: short answers
    train_q = load_questions(args.train_prompts, offset=0)
    eval_q = load_questions(args.eval_prompts, offset=args.train_prompts)
    train_data = generate_examples(llm, train_q, args.max_tokens)
    eval_data = generate_examples(llm, eval_q, args.max_tokens)
    del llm
    n_train = sum(len(ex.answer) for ex in train_data)
    print(f"   {len(train_data)} training answers ({n_train} tokens), {len(eval_data)} held-out "
          f"({time.monotonic() - t_start:.0f} s)", flush=True)

    print(f"2. draft = embeddings + layers {layers} + final norm of {target_dir.name}", flush=True)
    model = build_draft(target_dir, layers).eval()
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    before = token_agreement(model, eval_data, args.max_context)
    print(f"   {n_params / 1e6:.1f} M parameters ({n_trainable / 1e6:.1f} M trained); "
          f"held-out per-token agreement before training: {before:.3f}", flush=True)

    print(f"3. distillation for {args.train_seconds:.0f} s", flush=True)
    steps = train(model, train_data, args.train_seconds, args.batch_size, args.lr, args.max_context, args.positions)
    after = token_agreement(model, eval_data, args.max_context)
    print(f"   {steps} steps; held-out per-token agreement after training: {after:.3f}", flush=True)

    print(f"4. writing {out}", flush=True)
    save_draft(model, target_dir, out)

    print(f"5. K={args.k} speculative simulation on held-out prompts (DraftModelProposer, bfloat16)", flush=True)
    rate, mean_len = simulate_acceptance(out, target_dir, eval_data, args.k)
    print(f"   draft acceptance rate {rate:.3f}; mean accepted length {mean_len:.2f} drafts/step "
          f"({mean_len + 1:.2f} tokens/step)")
    print(f"done in {time.monotonic() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
