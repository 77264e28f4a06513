"""Peers measured in the same run as tandem: HF transformers `generate` and llama.cpp (llama-cpp-python).

Both get the same token ids and the same greedy decoding; llama.cpp gets a bf16 GGUF written from the same weights.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from tandem.bench.common import RunResult

T = TypeVar("T")


def hf_generate(
    model_dir: Path, prompts: Sequence[list[int]], max_tokens: int, batch_size: int, dtype: torch.dtype,
    fixed_length: bool, eos_ids: Sequence[int], pad_id: int, name: str = "hf-transformers",
) -> RunResult:
    """HF static batching: batches of `batch_size` left-padded prompts through `generate` (greedy)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    res = RunResult(name, len(prompts), 0, 0.0)
    t0 = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b : b + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        kw: dict[str, object] = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad_id)
        if fixed_length:
            kw.update(min_new_tokens=max_tokens)
        else:
            kw.update(eos_token_id=list(eos_ids))
        tb = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, **kw)[:, width:]
        dt = time.perf_counter() - tb
        for row in out.tolist():
            n = len(row)
            if not fixed_length:
                n = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
            res.output_tokens += n
            res.tpot_s.append(dt / max(n, 1))
    res.wall_s = time.perf_counter() - t0
    return res


def hf_prefill_s(model_dir: Path, prompts: Sequence[list[int]], dtype: torch.dtype) -> float:
    """HF's fastest forward pass over one of `prompts` (each alone, the logits of its last token kept, as a
    generation's prefill does), in seconds."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    best = float("inf")
    with torch.inference_mode():
        model(torch.tensor([prompts[0][:16]]))  # warm-up
        for p in prompts:
            t0 = time.perf_counter()
            model(torch.tensor([p]), logits_to_keep=1)
            best = min(best, time.perf_counter() - t0)
    return best


def llama_cpp_available(announce: bool = True) -> bool:
    """Whether the llama.cpp peer is installed and passed its smoke test here (`llama_peer.peer_status`); when it
    did not and `announce`, says why (benchmarks then leave it out)."""
    from tandem.bench.llama_peer import peer_status

    status = peer_status()
    if announce and not _ANNOUNCED:
        _ANNOUNCED.append(status.describe())
        print(status.describe() if status.usable else f"{status.describe()}; left out")
    return status.usable


_ANNOUNCED: list[str] = []  # the peer's line is printed once per process


def write_bf16_gguf(src: Path, dst: Path) -> Path:
    """Rewrite a GGUF with every quantized matrix dequantized to bf16 (norms stay f32), metadata copied."""
    import gguf

    if dst.is_file():
        return dst
    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch=arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        data = data.reshape(shape)
        if data.ndim == 1:
            writer.add_tensor(t.name, data)
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst


LLAMA_CPP_FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q6_K": 18, "Q4_K_M": 15, "Q5_K_M": 17, "BF16": 32}


def llama_cpp_quantize(src: Path, dst: Path, file_type: str, threads: int = 0) -> Path:
    """llama.cpp's own quantizer (`llama_model_quantize`, its type mix for _M files) from a GGUF, once; in its own
    process (llama.cpp's threads stay out of this one)."""
    if not dst.is_file():
        in_subprocess(_llama_cpp_quantize, src, dst, file_type, threads)
    return dst


def _llama_cpp_quantize(src: Path, dst: Path, file_type: str, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_CPP_FILE_TYPES[file_type]
    params.nthread = threads
    params.allow_requantize = True
    tmp = dst.with_name(dst.name + ".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {file_type} failed")
    tmp.rename(dst)


def llama_cpp_greedy(
    gguf_path: Path, prompts: Sequence[list[int]], max_tokens: int, threads: int = 0
) -> list[tuple[list[int], np.ndarray]]:
    """llama.cpp's greedy continuation of each prompt and, for each generated position, its logits [n, V] (recomputed
    over the whole sequence); float32 KV cache so only the weights' format differs from a float32 tandem run."""
    return in_subprocess(_llama_cpp_greedy, gguf_path, [list(p) for p in prompts], max_tokens, threads)


def _llama_cpp_greedy(
    gguf_path: Path, prompts: Sequence[list[int]], max_tokens: int, threads: int
) -> list[tuple[list[int], np.ndarray]]:
    import os

    from llama_cpp import GGML_TYPE_F32, Llama

    n_ctx = max(len(p) for p in prompts) + max_tokens + 8
    llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads or len(os.sched_getaffinity(0)),
                logits_all=True, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, verbose=False)
    out = []
    for p in prompts:
        llm.reset()
        tokens: list[int] = []
        for tok in llm.generate(p, temp=0.0, top_k=1, reset=True):
            tokens.append(int(tok))
            if len(tokens) >= max_tokens:
                break
        llm.reset()
        llm.eval(p + tokens[:-1])
        scores = np.array(llm.scores[len(p) - 1 : len(p) + len(tokens) - 1], dtype=np.float32)  # a copy: the buffer is reused
        out.append((tokens, scores))
    return out


def in_subprocess(fn: Callable[..., T], *args: Any) -> T:
    """Run a peer in a fresh process and return its (picklable) result.

    llama.cpp brings its own OpenMP runtime; its worker threads outlive the call and, in the same process, kept
    competing with tandem's threads for the two cores (tandem measured after llama.cpp ran 10-30% slower).
    """
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


def llama_cpp_generate(
    gguf_path: Path, prompts: Sequence[list[int]], max_tokens: int, fixed_length: bool, threads: int,
    eos_ids: Sequence[int], name: str = "llama.cpp",
) -> RunResult:
    """llama.cpp, one request at a time (its Python API has no continuous batching), greedy; in its own process."""
    return in_subprocess(_llama_cpp_generate, gguf_path, list(prompts), max_tokens, fixed_length, threads, list(eos_ids), name)


def _llama_cpp_generate(
    gguf_path: Path, prompts: Sequence[list[int]], max_tokens: int, fixed_length: bool, threads: int,
    eos_ids: Sequence[int], name: str,
) -> RunResult:
    from llama_cpp import Llama

    from tandem.runner.memory import resident_bytes

    before, _ = resident_bytes()
    ctx = max(len(p) for p in prompts) + max_tokens + 8
    llm = Llama(model_path=str(gguf_path), n_ctx=ctx, n_threads=threads, n_batch=512, verbose=False, logits_all=False)
    after, _ = resident_bytes()
    res = RunResult(name, len(prompts), 0, 0.0)
    t0 = time.perf_counter()
    for p in prompts:
        llm.reset()
        ts = time.perf_counter()
        n = 0
        first = None
        for tok in llm.generate(p, temp=0.0, top_k=1, reset=True):
            n += 1
            if first is None:
                first = time.perf_counter()
            if (not fixed_length and tok in eos_ids) or n >= max_tokens:
                break
        end = time.perf_counter()
        res.output_tokens += n
        res.ttft_s.append((first or end) - ts)
        if n > 1 and first is not None:
            res.tpot_s.append((end - first) / (n - 1))
    res.wall_s = time.perf_counter() - t0
    _, peak = resident_bytes()  # llama.cpp maps the file: the weights' pages count as they are read
    res.extra = {"rss_load_mib": round(after / 2**20), "rss_peak_mib": round(peak / 2**20),
                 "model_mib": round((after - before) / 2**20)}
    return res


def llama_cpp_batched(
    gguf_path: Path, prompts: Sequence[list[int]], max_tokens: int, threads: int, name: str = "llama.cpp -np N",
) -> tuple[RunResult, list[list[int]]]:
    """llama.cpp serving all `prompts` at once as `llama-server -np N` does (N = len(prompts)): one context with N
    sequences, their prompts prefilled together in 512-token batches, then one llama_decode a step holding every
    sequence's next token; greedy, fixed lengths (EOS ignored); in its own process. Returns the figures and each
    prompt's tokens."""
    return in_subprocess(_llama_cpp_batched, gguf_path, [list(p) for p in prompts], max_tokens, threads, name)


def _llama_cpp_batched(
    gguf_path: Path, prompts: list[list[int]], max_tokens: int, threads: int, name: str
) -> tuple[RunResult, list[list[int]]]:
    import llama_cpp as lc

    from tandem.runner.memory import resident_bytes

    before, _ = resident_bytes()
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(gguf_path).encode(), lc.llama_model_default_params())
    n, per_seq = len(prompts), max(len(p) for p in prompts) + max_tokens + 8
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n * per_seq, 512, 512, n
    cp.n_threads = cp.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cp)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(512, 0, 1)
    after, _ = resident_bytes()

    def decode(items: list[tuple[int, int, int, bool]]) -> list[int]:
        """(token, position, sequence, wants logits) per row -> the greedy next token of each row that wants one."""
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, logits
            batch.seq_id[i][0] = seq
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax())
                for i, item in enumerate(items) if item[3]]

    res = RunResult(name, n, 0, 0.0)
    t0 = time.perf_counter()
    rows = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
    nexts: list[int] = []
    for c in range(0, len(rows), 512):
        nexts += decode(rows[c : c + 512])
    first = time.perf_counter()
    res.ttft_s = [first - t0] * n
    outputs = [[t] for t in nexts]
    for step in range(1, max_tokens):
        nexts = decode([(t, len(p) + step - 1, s, True) for s, (t, p) in enumerate(zip(nexts, prompts))])
        for out, t in zip(outputs, nexts):
            out.append(t)
    res.wall_s = time.perf_counter() - t0
    res.output_tokens = n * max_tokens
    res.tpot_s = [(res.wall_s - (first - t0)) / max(1, max_tokens - 1)] * n
    _, peak = resident_bytes()
    res.extra = {"rss_load_mib": round(after / 2**20), "rss_peak_mib": round(peak / 2**20),
                 "model_mib": round((after - before) / 2**20)}
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
    return res, outputs


def hf_structured(engine, prompts: Sequence[list[int]], schema: dict | None, max_tokens: int) -> RunResult:  # type: ignore[no-untyped-def,type-arg]
    """HF `generate` with xgrammar's logits processor (the usual way to guide transformers), batch 1, greedy."""
    import json

    import transformers
    import xgrammar as xgr

    model_dir = Path(engine.config.model or "")
    dtype = getattr(torch, engine.config.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    hf_tok = engine.tokenizer.hf
    compiled = None
    if schema is not None:
        info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=model.config.vocab_size)
        compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False)
    res = RunResult("hf", len(prompts), 0, 0.0)
    t0 = time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        kw: dict = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=engine.tokenizer.eos_token_ids[0])  # type: ignore[type-arg]
        if compiled is not None:
            kw["logits_processor"] = [xgr.contrib.hf.LogitsProcessor(compiled)]
        with torch.inference_mode():
            out = model.generate(ids, **kw)[0, ids.shape[1]:]
        res.output_tokens += int(out.shape[0])
    res.wall_s = time.perf_counter() - t0
    return res


def llama_cpp_structured(prompts: Sequence[list[int]], schema: dict | None, max_tokens: int) -> RunResult:  # type: ignore[type-arg]
    """llama.cpp (bf16 GGUF of the demo model) with its JSON-schema grammar, batch 1, greedy; in its own process."""
    return in_subprocess(_llama_cpp_structured, list(prompts), schema, max_tokens)


def _llama_cpp_structured(prompts: Sequence[list[int]], schema: dict | None, max_tokens: int) -> RunResult:  # type: ignore[type-arg]
    import json

    from llama_cpp import Llama, LlamaGrammar

    from tandem.models.demo import find_demo_gguf
    from tandem.paths import tandem_home

    dst = tandem_home() / "models" / "SmolLM2-135M-Instruct.bf16.gguf"
    dst.parent.mkdir(parents=True, exist_ok=True)
    path = write_bf16_gguf(find_demo_gguf(), dst)
    llm = Llama(model_path=str(path), n_ctx=2048, n_threads=len(__import__("os").sched_getaffinity(0)), verbose=False)
    grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False) if schema is not None else None
    res = RunResult("llama.cpp", len(prompts), 0, 0.0)
    t0 = time.perf_counter()
    for p in prompts:
        out = llm.create_completion(prompt=p, max_tokens=max_tokens, temperature=0.0, grammar=grammar)
        res.output_tokens += int(out["usage"]["completion_tokens"])  # type: ignore[index]
    res.wall_s = time.perf_counter() - t0
    return res
