"""The offline API, shaped like vLLM's: `LLM(model=...)`, `generate`, `chat`."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from tandem.config import CacheConfig, ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from tandem.cpu_budget import CpuBudget, pin_current_thread_pool, plan_cpu_budget
from tandem.engine.engine import LLMEngine, freeze_startup_heap
from tandem.engine.speculation import NoSpeculation, Speculation, SpeculativeDecoder
from tandem.layers.kernels import load_cpu_kernels
from tandem.layers.moe_offload import OffloadSetting, check_offload_setting, host_expert_layers
from tandem.models.checkpoint import Checkpoint, resolve_dtype
from tandem.models.loader import load_checkpoint
from tandem.params import EngineOverloaded, ParamError, RequestOutputKind, SamplingParams
from tandem.reasoning import Reasoner
from tandem.request import RequestOutput
from tandem.runner.distributed import (
    ProcessLauncher,
    TensorParallelRunner,
    WorkerLauncher,
    WorkerSpec,
    free_tcp_address,
)
from tandem.runner.runner import ModelRunner
from tandem.runner.tensor_thread import on_tensor_thread
from tandem.spec_decode.config import SpeculativeConfig, build_proposer
from tandem.structured.manager import StructuredOutputConfig
from tandem.tokenizer import Tokenizer
from tandem.tools import ToolParser, ToolPlan, choose_parser

logger = logging.getLogger("tandem")

# A prompt: text, token ids, or vLLM's dict forms {"prompt": ...} / {"prompt_token_ids": [...]}.
PromptType = str | Sequence[int] | Mapping[str, Any]  # noqa: UP007 (a runtime alias on Python 3.10)
ChatMessages = list[dict[str, Any]]


def build_engine(
    model: str | os.PathLike[str] | Checkpoint | None = None,
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int | None = None,
    block_size: int = 16,
    kv_cache_memory: int | None = None,
    memory_fraction: float | None = None,
    kv_share: float = 1.0,  # of the host's memory and default KV pool: data-parallel replicas on one host split it
    num_kv_blocks: int | None = None,
    enable_prefix_caching: bool = True,
    seed: int = 0,
    num_threads: int | None = None,
    cpu_kernels: bool = True,
    chat_template: str | None = None,
    speculative_config: Mapping[str, Any] | SpeculativeConfig | None = None,
    structured_outputs_config: Mapping[str, Any] | StructuredOutputConfig | None = None,
    structured_mask_mode: str | None = None,
    async_scheduling: bool | None = None,
    quantization: str | None = None,
    tensor_parallel_size: int = 1,
    distributed_executor_backend: str = "mp",
    cpu_cores: Sequence[int] | None = None,
    reasoning_parser: str | Mapping[str, Any] | None = None,
    cpu_offload_experts: OffloadSetting = None,
    progress: bool = True,
) -> LLMEngine:
    """Load a checkpoint (the built-in demo model when `model` is None; a `Checkpoint` as it is) and build an engine.

    `quantization`: None keeps a GGUF's quantized blocks as stored (CPU kernels; dequantized on an accelerator),
    "none" dequantizes them to `dtype`, "int8" stores dense matrices (safetensors) as per-channel int8.
    `tensor_parallel_size` > 1 shards the model over that many ranks (`runner/distributed.py`; worker processes, or
    Ray actors with `distributed_executor_backend="ray"`); `cpu_cores`: the cores this engine may use (pinned);
    `reasoning_parser`: a name or {"name": ..., options}, None for the chat format's (harmony's); `kv_share`: this
    engine's part of the host; `cpu_offload_experts`: "all" or N, the MoE layers (below N) with host experts."""
    _before_load(device, cpu_cores, cpu_offload_experts)
    path, ckpt = _checkpoint(model, dtype, progress, quantization)
    cache = CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory, memory_fraction=memory_fraction, share=kv_share,
                        enable_prefix_caching=enable_prefix_caching, num_blocks=num_kv_blocks)
    config = EngineConfig(model=str(path), model_config=ckpt.config, dtype=str(ckpt.weights.dtype).removeprefix("torch."),
                          device=device, seed=seed, cache=cache, num_threads=num_threads,
                          scheduler=_scheduler_config(ckpt.config, max_model_len, max_num_seqs, max_num_batched_tokens))
    tok = _tokenizer(ckpt, tokenizer, chat_template)
    reasoner = choose_reasoner(reasoning_parser, tok)
    sc = SpeculativeConfig.from_dict(speculative_config) if speculative_config is not None else None
    so_config = _structured_config(structured_outputs_config)
    budget = _cpu_budget(config, sc, so_config if structured_outputs_config is not None else None, cpu_cores, cpu_offload_experts)
    so_config = dataclasses.replace(so_config, num_threads=budget.grammar_threads)
    runner = _runner(ckpt, config, budget, cpu_kernels, quantization, tensor_parallel_size, distributed_executor_backend, cpu_offload_experts)
    del ckpt
    _after_load(runner, cpu_kernels, structured_mask_mode, progress)
    speculation = _speculation(sc, budget, config.model_config.vocab_size, tok, config.scheduler.max_model_len)
    engine = LLMEngine(config, runner, tok, speculation=speculation, structured_config=so_config, reasoner=reasoner,
                       mask_mode=structured_mask_mode, cpu_budget=budget, async_scheduling=async_scheduling)
    freeze_startup_heap()  # the long-lived objects of torch and the model never need scanning again: no GC pauses
    return engine


def _before_load(device: str, cpu_cores: Sequence[int] | None, cpu_offload_experts: OffloadSetting) -> None:
    """What must hold before the checkpoint loads: the process pinned to `cpu_cores` (before the tensor thread
    starts: it and its team inherit them), the device and the offload setting valid (a typo fails fast)."""
    if cpu_cores is not None:
        pin_current_thread_pool(tuple(cpu_cores))
    _check_device(device)
    check_offload_setting(cpu_offload_experts)


def choose_reasoner(parser: str | Mapping[str, Any] | None, tok: Tokenizer) -> Reasoner | None:
    """The reasoning parser asked for, else the one the chat format implies (harmony's), else none."""
    chosen = parser if parser is not None else tok.chat_format.reasoning_parser
    return Reasoner(chosen, tok) if chosen is not None else None


def _after_load(runner: ModelRunner, cpu_kernels: bool, mask_mode: str | None, progress: bool) -> None:
    """Print the memory summary (`progress`). An accelerator whose logits are brought to the host (mask mode "cpu")
    samples greedy rows there in one fused pass (`greedy_tokens`); load the CPU kernels for it (a CPU model loads
    them itself, unless `cpu_kernels=False`)."""
    if progress:
        print(f"tandem: {runner.memory_summary()}", file=sys.stderr, flush=True)
    if cpu_kernels and mask_mode == "cpu" and runner.device.type != "cpu":
        load_cpu_kernels()


def _runner(
    ckpt: Checkpoint, config: EngineConfig, budget: CpuBudget, cpu_kernels: bool, quantization: str | None, tp_size: int,
    executor: str, cpu_offload_experts: OffloadSetting = None,
) -> ModelRunner:
    """One device's runner, or rank 0 of a tensor-parallel group (whose workers load the checkpoint themselves),
    its workers local processes (`executor` "mp") or Ray actors ("ray"). Experts on the host want one device, not a group."""
    dtype = ckpt.weights.dtype
    if tp_size < 1:
        raise ConfigError(f"tensor_parallel_size must be at least 1, got {tp_size}")
    if executor not in ("mp", "ray"):
        raise ConfigError(f"distributed_executor_backend must be 'mp' or 'ray', got {executor!r}")
    if tp_size > 1 and host_expert_layers(ckpt.config, cpu_offload_experts):
        raise ConfigError("cpu_offload_experts does not combine with tensor_parallel_size > 1; use one of them")
    if tp_size == 1:
        return ModelRunner(ckpt.config, ckpt.weights, dtype, config.device, config.cache, config.scheduler,
                           num_threads=budget.forward_threads, use_kernels=cpu_kernels, cpu_offload_experts=cpu_offload_experts)
    spec = WorkerSpec(model_path=str(config.model), dtype=str(dtype).removeprefix("torch."), quantization=quantization,
                      device=config.device, cache=config.cache, scheduler=config.scheduler, use_kernels=cpu_kernels,
                      rank=0, size=tp_size, init_method="", cores=budget.forward_cores,
                      num_threads=budget.forward_threads)
    launcher: WorkerLauncher = ProcessLauncher()
    if executor == "ray":
        from tandem.runner.ray_launcher import RayLauncher

        launcher = RayLauncher()
    spec = dataclasses.replace(spec, init_method=free_tcp_address(launcher.driver_host()))
    return TensorParallelRunner(ckpt.config, ckpt.weights, spec, launcher)


def _checkpoint(
    model: str | os.PathLike[str] | Checkpoint | None, dtype: str, progress: bool, quantization: str | None
) -> tuple[Path, Checkpoint]:
    """What to serve: `model` itself when built in memory (random weights generated on the device, tests), else the
    checkpoint loaded from its path (on the tensor thread)."""
    if isinstance(model, Checkpoint):
        return Path(f"<{model.source}>"), model
    path, dtype = _resolve_model(model, dtype)
    return path, on_tensor_thread(_load, path, dtype, progress, quantization)


def _resolve_model(model: str | os.PathLike[str] | None, dtype: str) -> tuple[Path, str]:
    """The checkpoint path (the demo model, converted once, when None) and the dtype to load it in."""
    if model is not None:
        return Path(model), dtype
    from tandem.models.demo import demo_model_path

    path = on_tensor_thread(demo_model_path)  # converts once; tensor work stays on the tensor thread
    # the demo folder holds float32 dequantized weights; serve them in bf16
    return path, "bfloat16" if dtype == "auto" else dtype


def _scheduler_config(
    cfg: ModelConfig, max_model_len: int | None, max_num_seqs: int, max_num_batched_tokens: int | None
) -> SchedulerConfig:
    """Batching limits: max_model_len within the model's positions, the batched-token default from it."""
    if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}")
    max_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or max(512, min(2048, max_len)),
        max_model_len=max_len,
    )


def _tokenizer(ckpt: Checkpoint, path: str | os.PathLike[str] | None, chat_template: str | None) -> Tokenizer:
    tok = Tokenizer.from_path(Path(path) if path else ckpt.tokenizer_path, chat_template=chat_template)
    if chat_template is None and ckpt.chat_template and not tok.has_chat_template:
        tok.set_chat_template(ckpt.chat_template)
    return tok


def _draft_on_cpu(sc: SpeculativeConfig | None) -> bool:
    """A draft model in its own process on the host's cores."""
    return sc is not None and sc.method == "draft_model" and sc.draft_device == "cpu" and not sc.draft_in_process


def _cpu_budget(
    config: EngineConfig, sc: SpeculativeConfig | None, so_config: StructuredOutputConfig | None,
    cores: Sequence[int] | None = None, cpu_offload_experts: OffloadSetting = None,
) -> CpuBudget:
    """The engine's split of the cores; experts on the host make the forward a host computation."""
    return plan_cpu_budget(
        cores=tuple(cores) if cores is not None else None, host_experts=bool(host_expert_layers(config.model_config, cpu_offload_experts)),
        device=torch.device(config.device).type, draft_on_cpu=_draft_on_cpu(sc), forward_threads=config.num_threads,
        grammar_threads=so_config.num_threads if so_config is not None else None,
        draft_threads=sc.draft_threads if sc else None, draft_cores=sc.draft_cores if sc else None,
    )


def _speculation(
    sc: SpeculativeConfig | None, budget: CpuBudget, vocab_size: int, tok: Tokenizer, max_len: int
) -> Speculation:
    """The engine's speculation; a draft worker on the CPU gets the budget's cores and the forward keeps the rest."""
    if sc is None:
        return NoSpeculation()
    if _draft_on_cpu(sc):
        sc = dataclasses.replace(sc, draft_cores=budget.draft_cores, draft_threads=budget.draft_threads)
    speculation = SpeculativeDecoder(sc, build_proposer(sc, vocab_size, tok), max_len)
    logger.info("speculative decoding: %s, K=%d, adaptive=%s", sc.method, sc.num_speculative_tokens, sc.adaptive)
    if _draft_on_cpu(sc) and set(budget.forward_cores) != set(budget.cores):
        pin_current_thread_pool(budget.forward_cores)  # the draft worker has its own cores now
    return speculation


def _structured_config(value: Mapping[str, Any] | StructuredOutputConfig | None) -> StructuredOutputConfig:
    if value is None:
        return StructuredOutputConfig()
    if isinstance(value, StructuredOutputConfig):
        return value
    try:
        return StructuredOutputConfig(**dict(value))
    except (TypeError, ValueError) as e:  # an unknown setting, or one of the wrong type or range (named)
        raise ConfigError(f"structured_outputs_config: {e}") from e


def _load(path: Path, dtype: str, progress: bool, quantization: str | None = None) -> Checkpoint:
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype must be one of 'auto', 'float32', 'bfloat16', 'float16', got {dtype!r}")
    if path.is_dir() and (path / "config.json").is_file():
        torch_dtype = resolve_dtype(dtype, ModelConfig.from_json_file(path / "config.json"))
    else:
        torch_dtype = torch.bfloat16 if dtype == "auto" else getattr(torch, dtype)
    return load_checkpoint(path, torch_dtype, progress=progress, quantization=quantization)


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"device {device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1'): {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but torch sees no CUDA device; use device='cpu'")


class LLM:
    """Generate text offline for a list of prompts, as `vllm.LLM` does."""

    def __init__(self, model: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        self.llm_engine = build_engine(model, **_vllm_compat(kwargs))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Release the engine's threads and worker processes (also done at interpreter exit)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. Invalid input raises before anything runs."""
        items = _as_prompt_list(prompts)
        params = _params_list(sampling_params, len(items))
        return self._run(items, params, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate.

        `tools` (OpenAI function tools) go to the template as its `tools` argument, as in vLLM; a template that knows
        no tools gets tandem's fallback prompt (docs/tool_calling.md). tandem's addition: a `tool_choice` ("auto",
        "required" or {"type": "function", "function": {"name": ...}}) also holds the calls to their functions'
        schemas with the tool grammar (it replaces the params' structured_outputs, whose backend it keeps); read calls
        back with `tool_parser().parse(output.outputs[0].text)` (gpt-oss's harmony reads the token ids: pass
        `output.outputs[0].token_ids` too; its "required" / named calls hold the analysis to their grammar as well).
        Without `tool_choice`, tools are only shown.
        """
        convs: list[ChatMessages] = [messages] if messages and isinstance(messages[0], dict) else list(messages)  # type: ignore[list-item,arg-type]
        tok = self.llm_engine.tokenizer
        if chat_template is not None:
            tok.set_chat_template(chat_template)
        plan = ToolPlan.build(tools, "none" if tool_choice is None else tool_choice, parallel_tool_calls,
                              *choose_parser("auto", tok.hf.chat_template, tok.chat_format.tool_call_parser)) if tools else None
        kwargs = {**(chat_template_kwargs or {}), **(plan.template_kwargs() if plan is not None else {})}
        items: list[PromptType] = [
            tok.apply_chat_template(plan.conversation(c) if plan is not None else c, add_generation_prompt=add_generation_prompt,
                                    **kwargs)
            for c in convs
        ]
        params = _params_list(sampling_params, len(items))
        return self._run(items, params if plan is None else [plan.apply(p) for p in params], use_tqdm)

    def tool_parser(self) -> ToolParser:
        """The tool-call parser of this model's chat template (Hermes for templates that know no tools)."""
        tok = self.llm_engine.tokenizer
        return choose_parser("auto", tok.hf.chat_template, tok.chat_format.tool_call_parser)[0]

    def _run(self, items: list[PromptType], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [f"gen-{next(self._ids)}" for _ in items]
        prompts = [_prompt_of(item) for item in items]  # invalid input raises here, before anything runs
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        final = {id(p): p.clone(output_kind=RequestOutputKind.FINAL_ONLY) for p in params}  # as vLLM's LLM does
        queued = [(rid, prompt, final[id(p)]) for rid, prompt, p in zip(ids, prompts, params, strict=True)][::-1]
        try:
            while queued or engine.has_unfinished_requests():
                self._add_while_room(queued)
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in ids:
                if rid not in results:
                    engine.abort_request(rid)
        return [results[rid] for rid in ids]

    def _add_while_room(self, queued: list[tuple[str, str | list[int], SamplingParams]]) -> None:
        """Add queued requests (last first) until the engine is overloaded (e.g. its grammar compile queue is
        full): the rest wait for the next step. Any other refusal raises; the caller aborts what was added."""
        engine = self.llm_engine
        while queued:
            rid, prompt, p = queued[-1]
            try:
                engine.add_request(rid, prompt, p)
            except EngineOverloaded:
                if not engine.has_unfinished_requests():
                    raise
                return
            queued.pop()


# vLLM arguments with a tandem meaning, and ones that change nothing here (accepted so scripts run unchanged)
_VLLM_RENAMED = {"gpu_memory_utilization": "memory_fraction", "kv_cache_memory_bytes": "kv_cache_memory",
                 "num_gpu_blocks_override": "num_kv_blocks"}
_VLLM_NO_EFFECT = {"trust_remote_code", "enforce_eager", "disable_log_stats", "tokenizer_mode", "swap_space"}


def _vllm_compat(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in kwargs.items():
        if k in _VLLM_NO_EFFECT:
            continue
        if k == "tensor_parallel_size" and v is None:
            continue
        out[_VLLM_RENAMED.get(k, k)] = v
    if "memory_fraction" in out:
        out["memory_fraction"] = min(0.95, float(out["memory_fraction"]))
    if out.get("quantization") == "gguf":  # vLLM's name for running a GGUF file's own quantization
        out["quantization"] = None
    return out


def _prompt_of(item: PromptType) -> str | list[int]:
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping):
        if "prompt_token_ids" in item:
            return [int(t) for t in item["prompt_token_ids"]]
        if "prompt" in item:
            return str(item["prompt"])
        raise ParamError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(item)}")
    return [int(t) for t in item]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    seq = list(prompts)
    if seq and all(isinstance(t, int) for t in seq):
        return [[int(t) for t in seq]]  # type: ignore[arg-type]  # one prompt of token ids
    return seq  # type: ignore[return-value]


def _params_list(p: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if p is None:
        return [SamplingParams()] * n
    if isinstance(p, SamplingParams):
        return [p] * n
    ps = list(p)
    if len(ps) != n:
        raise ParamError(f"got {len(ps)} SamplingParams for {n} prompts; give one, or one per prompt")
    return ps
