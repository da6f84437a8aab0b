"""Offline batched inference from Python, in vLLM's shape:

    from gaudi_runtime import LLM, SamplingParams

    with LLM(model="/models/llama", dtype="bfloat16", num_shard=2) as llm:
        outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(temperature=0, max_tokens=32))
        print(outs[0].outputs[0].text)

The same engine as `gaudi-serve launch` without HTTP: the shards are spawned as the launcher spawns
them and the router's batching engine runs in a background event loop of this process, so every
prompt of a `generate` call is continuously batched. Any launcher flag is a keyword argument
(`block_size=16`, `max_batch_prefill_tokens=4096`) and so is any environment setting
(`warmup_enabled=False`, `pad_sequence_to_multiple_of=64`).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field, replace

from gaudi_runtime.config import ENV_ONLY, FLAGS, Config, resolve

_FLAG_NAMES = {flag.lstrip("-").replace("-", "_") for flag, *_ in FLAGS}
_ENV_NAMES = {env.lower(): env for env, *_ in ENV_ONLY}


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's sampling parameters (the subset the engine implements). temperature 0 is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): off
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0  # OpenAI's (and vLLM's) meaning: over the generated tokens
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to --max-total-tokens
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        # vLLM's own range checks (the router's limits apply on top, in generate).
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or positive, got {self.top_k}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

    def tgi_parameters(self) -> dict:
        """The same request as TGI `parameters` (validated by the router's own rules)."""
        sample = self.temperature > 0
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "do_sample": sample,
            "temperature": self.temperature if sample else None,
            "top_p": self.top_p if sample and self.top_p < 1.0 else None,
            "top_k": self.top_k if sample and self.top_k > 0 else None,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "max_new_tokens": self.max_tokens,
            "stop": stop,
            "ignore_eos": self.ignore_eos,
        }


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length", as vLLM
    stop_reason: str | None = None  # the stop string that ended it, if one did
    cumulative_logprob: float = 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def engine_config(model: str, *, dtype: str, num_shard: int, max_model_len: int | None,
                  max_num_seqs: int | None, settings: dict, environ: dict[str, str] | None = None) -> Config:
    """The launcher's Config from keyword arguments: flag names as flags, environment setting names as env."""
    args = argparse.Namespace(model_id=model, dtype=None if dtype == "auto" else dtype, num_shard=num_shard,
                              max_total_tokens=max_model_len, max_batch_size=max_num_seqs)
    env = dict(os.environ if environ is None else environ)
    for name, value in settings.items():
        if name in _FLAG_NAMES:
            setattr(args, name, value)
        elif name in _ENV_NAMES:
            env[_ENV_NAMES[name]] = str(value).lower() if isinstance(value, bool) else str(value)
        else:
            raise TypeError(f"LLM() got an unknown setting {name!r}")
    if num_shard == 1:
        args.sharded = False
    return resolve(args, env, device_count=lambda _device: num_shard)


def _finish_reason(end, stop: list[str], include_stop: bool) -> tuple[str, str, str | None]:
    """(text, vLLM finish reason, stop string) of an engine GenerationEnd."""
    from gaudi_runtime.router.types import FinishReason

    text = end.generated_text
    if end.finish_reason == FinishReason.LENGTH:
        return text, "length", None
    if end.finish_reason == FinishReason.STOP_SEQUENCE:
        # The engine stops on the token that completes a stop string (TGI keeps that whole token);
        # vLLM's text ends at the stop string, which it leaves out unless asked.
        found = [(text.find(s), s) for s in stop if s in text]
        if found:
            at, hit = min(found)
            return text[: at + len(hit) if include_stop else at], "stop", hit
        return text, "stop", None
    return text, "stop", None


class LLM:
    """An in-process engine over N shards; use as a context manager or call `close()`."""

    def __init__(self, model: str, *, dtype: str = "auto", num_shard: int = 1, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, start_timeout_s: float = 3600.0, **settings):
        from gaudi_runtime import launcher
        from gaudi_runtime.quant.config import check_quant_config

        self._procs: list = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine = None
        # Private shard sockets: several engines (and servers) may run on one machine.
        self._tmp = tempfile.mkdtemp(prefix="gaudi-serve-llm-")
        atexit.register(self.close)  # no shard outlives the program, even without close()
        try:
            settings.setdefault("shard_uds_path", os.path.join(self._tmp, "shard"))
            self.config = cfg = engine_config(model, dtype=dtype, num_shard=num_shard, max_model_len=max_model_len,
                                              max_num_seqs=max_num_seqs, settings=settings)
            self.model_dir = launcher.resolve_model_dir(cfg)
            launcher.check_model(self.model_dir)
            check_quant_config(cfg)
            launcher.check_quantized(cfg, self.model_dir)
            # Spawned from this thread: a shard dies with the thread that started it (PR_SET_PDEATHSIG).
            self._procs = launcher.spawn_shards(cfg, self.model_dir)
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="gaudi-serve-llm", daemon=True)
            self._thread.start()
            self._call(self._start(start_timeout_s))
        except BaseException:
            self.close()
            raise

    async def _start(self, timeout_s: float) -> None:
        from gaudi_runtime.router.client import ShardClient
        from gaudi_runtime.router.engine import BatchingEngine
        from gaudi_runtime.router.tokenizer import RouterTokenizer

        cfg = self.config
        self.tokenizer = RouterTokenizer.load(self.model_dir, cfg.model)
        client = ShardClient([cfg.server.shard_socket(r) for r in range(cfg.device.num_shard)])
        self._engine = BatchingEngine(cfg, client, self.tokenizer)
        def alive() -> bool:
            return all(p.poll() is None for _, p in self._procs)

        try:
            await self._engine.start(timeout_s, alive)
        except Exception as e:
            dead = [f"{name} exited with code {p.returncode}" for name, p in self._procs if p.poll() is not None]
            raise RuntimeError(f"the engine did not start: {'; '.join(dead) or e}") from e

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def get_tokenizer(self):
        """The Hugging Face tokenizer the engine uses."""
        return self.tokenizer.hf

    # ---- generation ------------------------------------------------------------------

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for one prompt or many (text, or a list of token ids each), batched by the engine.
        Outputs are in prompt order. Invalid parameters raise ValueError with the router's message."""
        if self._engine is None:
            raise RuntimeError("this LLM is closed")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
        requests = [self._validate(p, sp) for p, sp in zip(prompts, params, strict=True)]
        ends = self._call(self._run_all([r for r, _ in requests]))
        outs = []
        for i, ((req, prompt), sp, (ids, end, logprob)) in enumerate(zip(requests, params, ends, strict=True)):
            stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
            text, reason, hit = _finish_reason(end, stop, sp.include_stop_str_in_output)
            outs.append(RequestOutput(request_id=str(i), prompt=prompt, prompt_token_ids=list(req.input_ids),
                                      outputs=[CompletionOutput(0, text, ids, reason, hit, logprob)]))
        return outs

    def _validate(self, prompt, sp: SamplingParams):
        from gaudi_runtime.router.request_models import GenerateParameters, parse_request
        from gaudi_runtime.router.validation import tgi_options, tokenize_input, validate

        if isinstance(prompt, str):
            text, ids = prompt, tokenize_input(prompt, self.tokenizer)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise TypeError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}")
        limits = self.config.limits
        params = parse_request(GenerateParameters, sp.tgi_parameters())
        # vLLM's penalties are OpenAI's (over the generated tokens), which TGI's parameters do not hold.
        options = replace(tgi_options(params, limits, self.config.structured_output),
                          generated_frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty)
        return validate(text or "", ids, options, limits), text

    async def _run_all(self, requests) -> list:
        return await asyncio.gather(*(self._run(r) for r in requests))

    async def _run(self, request):
        from gaudi_runtime.router.types import GenerationError

        ids, logprob = [], 0.0
        agen = self._engine.generate(request)
        try:
            async for ev in agen:
                ids.append(ev.token.id)
                logprob += ev.token.logprob
                if ev.end is not None:
                    return ids, ev.end, logprob
        except GenerationError as e:
            raise RuntimeError(f"generation failed: {e}") from e
        finally:
            await agen.aclose()
        raise RuntimeError("the engine ended a request without a final token")

    # ---- life cycle --------------------------------------------------------------------

    async def _shutdown(self) -> None:
        await self._engine.stop()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def close(self) -> None:
        """Stop the engine and every shard process; idempotent."""
        from gaudi_runtime import launcher

        atexit.unregister(self.close)
        if self._loop is not None:
            if self._engine is not None and self._thread.is_alive():
                try:
                    self._call(self._shutdown())
                except Exception:  # noqa: BLE001 - a failed engine still has its shards to stop
                    pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            self._loop = None
        self._engine = None
        launcher.stop_all(self._procs)
        self._procs = []
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
