"""Offline throughput: tailserve vs transformers (vs llama.cpp) on one request set, in one run.

One request set (random token ids, fixed seed) goes through

  1. tailserve ``LLM.generate`` -- every request at once, continuous batching;
  2. transformers ``generate`` on the *same* float weights (a ``LlamaForCausalLM`` built from the
     tailserve-loaded config and tensors), static batches with left padding, greedy;
  3. llama-cpp-python, one request after another, when it is importable;

then a single-stream decode (one request) is timed against the memory roofline
(bytes of weights read per token ÷ measured memory bandwidth, see roofline.py).

    python benchmarks/offline_throughput.py                       # the issue's defaults
    python benchmarks/offline_throughput.py --hf-num-prompts 16   # transformers on a prefix
    python benchmarks/offline_throughput.py --num-prompts 4 --output-len-range 8 16  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from roofline import decode_bytes, measure_bandwidth
from tailserve import LLM, SamplingParams
from tailserve.data.step import StepStats
from tailserve.model.quant.formats import dequantize_reference, is_packed

DEFAULT_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "auto",
    "kv_cache_memory": 2.0,
    "max_num_seqs": 64,
    "max_num_batched_tokens": 512,
}


# --------------------------------------------------------------------------- request set
@dataclass(frozen=True)
class RequestSpec:
    prompt_token_ids: list[int]
    output_len: int


def make_requests(
    num: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    excluded_ids: set[int],
    seed: int,
) -> list[RequestSpec]:
    """Uniform lengths, uniform token ids over the vocabulary minus special/added tokens.

    Random ids rather than text: the prompt length is then exact (no tokenizer round trip)
    and no two prompts share a prefix, so prefix caching cannot flatter tailserve.
    """
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in excluded_ids]
    reqs = []
    for _ in range(num):
        n_in = rng.randint(*input_range)
        n_out = rng.randint(*output_range)
        reqs.append(RequestSpec([rng.choice(allowed) for _ in range(n_in)], n_out))
    return reqs


def special_token_ids(tokenizer: Any) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    # Added tokens (<|im_start|>, <repo_name>, ...) are control tokens in practice.
    ids.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
    return ids


# --------------------------------------------------------------------------- results
@dataclass
class PhaseResult:
    name: str
    num_requests: int
    wall_s: float
    prompt_tokens: int
    output_tokens: int  # useful output: each request's requested tokens, nothing more
    generated_tokens: int  # what the engine actually computed (transformers pads batches)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["output_tokens_per_s"] = self.output_tps
        d["total_tokens_per_s"] = self.total_tps
        return d


def step_summary(stats: Sequence[StepStats]) -> dict[str, Any]:
    """Where the engine's steps went: prefill-carrying vs decode-only, batch sizes."""
    if not stats:
        return {}
    decode_only = [s for s in stats if s.num_prefill_tokens == 0]
    with_prefill = [s for s in stats if s.num_prefill_tokens > 0]
    out: dict[str, Any] = {
        "num_steps": len(stats),
        "steps_with_prefill": len(with_prefill),
        "time_in_steps_s": sum(s.step_s for s in stats),
        "time_in_prefill_steps_s": sum(s.step_s for s in with_prefill),
        "time_in_decode_only_steps_s": sum(s.step_s for s in decode_only),
        "num_preemptions": sum(s.num_preemptions for s in stats),
        "mean_decode_seqs_per_step": statistics.fmean(s.num_decode_seqs for s in stats),
        "max_running": max(s.num_running for s in stats),
    }
    if decode_only:
        ms_per_seq = [1e3 * s.step_s / s.num_decode_seqs for s in decode_only]
        out["decode_only_step_ms_median"] = 1e3 * statistics.median(s.step_s for s in decode_only)
        out["decode_only_ms_per_seq_median"] = statistics.median(ms_per_seq)
        # Per-sequence cost by batch size: if it does not fall as the batch grows, the step is
        # bound by per-sequence work (attention over the context), not by the weights.
        buckets: dict[str, list[StepStats]] = {}
        for s in decode_only:
            lo = 1 << (s.num_decode_seqs - 1).bit_length()  # 1, 2, 4, 8, ... upper edges
            buckets.setdefault(f"<={lo}", []).append(s)
        out["decode_only_by_batch"] = {
            k: {
                "steps": len(v),
                "step_ms_median": 1e3 * statistics.median(s.step_s for s in v),
                "ms_per_seq_median": statistics.median(
                    1e3 * s.step_s / s.num_decode_seqs for s in v
                ),
            }
            for k, v in sorted(buckets.items(), key=lambda kv: int(kv[0][2:]))
        }
    return out


# --------------------------------------------------------------------------- tailserve
@contextlib.contextmanager
def progress(llm: LLM, total: int, every_s: float) -> Iterator[None]:
    """Print steps and finished requests every ``every_s`` seconds from a side thread: a long
    run on a shared machine should show it is alive. It only reads ``llm.step_stats``."""
    stop = threading.Event()
    t0 = time.perf_counter()

    def report() -> None:
        while not stop.wait(every_s):
            stats = list(llm.step_stats)
            done = sum(s.num_finished for s in stats)
            print(f"    ... {time.perf_counter() - t0:7.0f} s: {len(stats)} steps, "
                  f"{done}/{total} requests finished, load {load_average()}", flush=True)

    thread = threading.Thread(target=report, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_tailserve(
    llm: LLM, reqs: Sequence[RequestSpec], name: str = "tailserve", progress_s: float = 0.0
) -> PhaseResult:
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [
        SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in reqs
    ]
    llm.step_stats.clear()
    ctx = progress(llm, len(reqs), progress_s) if progress_s > 0 else contextlib.nullcontext()
    with ctx:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    short = [(i, g, r.output_len) for i, (g, r) in enumerate(zip(got, reqs, strict=True))
             if g != r.output_len]
    if short:
        raise RuntimeError(f"tailserve returned the wrong number of tokens: {short[:5]}")
    summary = step_summary(list(llm.step_stats))
    # Time in LLM.generate outside engine steps: output processing, detokenization, adding.
    summary["outside_steps_s"] = wall - summary.get("time_in_steps_s", 0.0)
    return PhaseResult(
        name=name,
        num_requests=len(reqs),
        wall_s=wall,
        prompt_tokens=sum(len(r.prompt_token_ids) for r in reqs),
        output_tokens=sum(got),
        generated_tokens=sum(got),
        extra={"steps": summary, "load_average_after": load_average(),
               "token_ids": [o.outputs[0].token_ids for o in outs]},
    )


def single_stream(
    llm: LLM, prompt_len: int, output_len: int, repeats: int, vocab: list[int], seed: int
) -> dict[str, Any]:
    """TPOT of one request alone: (e2e - ttft) / (n - 1), from the engine's own timing."""
    rng = random.Random(seed)
    tpots: list[float] = []
    step_ms: list[float] = []
    for _ in range(repeats):
        # A fresh prompt each time: a prefix cache hit would skip the prefill, not the decode,
        # but keep the runs identical in what they compute.
        ids = [rng.choice(vocab) for _ in range(prompt_len)]
        llm.step_stats.clear()
        out = llm.generate(
            [{"prompt_token_ids": ids}],
            [SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)],
        )[0]
        t = out.timing[0]
        n = len(out.outputs[0].token_ids)
        tpots.append((t["e2e_s"] - t["ttft_s"]) / (n - 1))
        step_ms.extend(1e3 * s.step_s for s in llm.step_stats if s.num_prefill_tokens == 0)
    return {
        "prompt_len": prompt_len,
        "output_len": output_len,
        "repeats": repeats,
        "tpot_ms": [1e3 * x for x in tpots],
        "tpot_ms_median": 1e3 * statistics.median(tpots),
        "tpot_ms_best": 1e3 * min(tpots),
        # The engine step alone, without LLM.generate's per-token output processing.
        "decode_step_ms_median": statistics.median(step_ms),
        "decode_step_ms_best": min(step_ms),
    }


# --------------------------------------------------------------------------- transformers
def build_hf_model(llm: LLM, dtype: torch.dtype) -> Any:
    """A transformers LlamaForCausalLM holding exactly the tensors tailserve loaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = llm.engine.loaded.config
    if cfg.architecture != "LlamaForCausalLM":
        raise NotImplementedError(f"transformers baseline only for Llama, got {cfg.architecture}")
    rope: dict[str, Any] = {"rope_type": "default", **(cfg.rope_scaling or {})}
    rope["rope_theta"] = cfg.rope_theta
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=cfg.attention_bias,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=None,
    )
    model: Any = LlamaForCausalLM(hf_cfg)  # Any: transformers' typing of .to() trips mypy
    # A GGUF served packed (--gguf-weights auto) keeps its matrices as blocks: their values.
    weights = {name: dequantize_reference(t) if is_packed(t) else t
               for name, t in llm.engine.loaded.weights.items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    allowed_missing = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(f"weight mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings and (
        model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    ):
        model.lm_head.weight = model.model.embed_tokens.weight
    # ignore_eos: with no EOS id generate never stops early, like tailserve's ignore_eos.
    model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


def run_transformers(
    model: Any, reqs: Sequence[RequestSpec], batch_size: int, pad_id: int
) -> PhaseResult:
    from transformers import GenerationConfig

    generated = 0
    token_ids: list[list[int]] = []
    batch_s: list[float] = []
    t0 = time.perf_counter()
    for b in range(0, len(reqs), batch_size):
        batch = reqs[b : b + batch_size]
        max_new = max(r.output_len for r in batch)
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):  # left padding: every prompt ends at the same column
            ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids) :] = 1
        gen_cfg = GenerationConfig(
            do_sample=False, max_new_tokens=max_new, min_new_tokens=0, pad_token_id=pad_id,
            eos_token_id=None,
        )
        tb = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
        batch_s.append(time.perf_counter() - tb)
        new = out[:, width:]
        if new.shape[1] != max_new:
            raise RuntimeError(f"transformers generated {new.shape[1]} tokens, wanted {max_new}")
        generated += new.numel()
        token_ids.extend(new[i, : r.output_len].tolist() for i, r in enumerate(batch))
    wall = time.perf_counter() - t0
    return PhaseResult(
        name="transformers",
        num_requests=len(reqs),
        wall_s=wall,
        prompt_tokens=sum(len(r.prompt_token_ids) for r in reqs),
        output_tokens=sum(r.output_len for r in reqs),
        generated_tokens=generated,
        extra={"batch_size": batch_size, "batch_s": batch_s,
               "load_average_after": load_average(), "token_ids": token_ids},
    )


def greedy_agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, Any]:
    """How far two greedy decodes of the same weights agree (fp32 op order may flip a
    near-tie; after that the continuations legitimately diverge)."""
    prefix = []
    for x, y in zip(a, b, strict=False):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n / max(len(x), 1))
    first_token = sum(1 for x, y in zip(a, b, strict=False) if x[:1] == y[:1])
    return {
        "requests": len(prefix),
        "identical": sum(1 for p in prefix if p == 1.0),
        "first_token_equal": first_token,
        "mean_common_prefix_frac": statistics.fmean(prefix) if prefix else 0.0,
    }


# --------------------------------------------------------------------------- llama.cpp
def run_llama_cpp(model_path: str, reqs: Sequence[RequestSpec], threads: int) -> PhaseResult:
    from llama_cpp import Llama  # the caller checked it imports

    n_ctx = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    lcpp = Llama(model_path=model_path, n_ctx=n_ctx, n_threads=threads, n_batch=512,
                 verbose=False)
    out_tokens = 0
    t0 = time.perf_counter()
    for r in reqs:
        n = 0
        # Llama.generate yields sampled tokens without stopping at EOS: ignore_eos for free.
        for _tok in lcpp.generate(r.prompt_token_ids, temp=0.0, top_k=1, reset=True):
            n += 1
            if n == r.output_len:
                break
        out_tokens += n
    wall = time.perf_counter() - t0
    return PhaseResult(
        name="llama.cpp",
        num_requests=len(reqs),
        wall_s=wall,
        prompt_tokens=sum(len(r.prompt_token_ids) for r in reqs),
        output_tokens=out_tokens,
        generated_tokens=out_tokens,
        extra={"model_path": model_path, "note": "runs the GGUF's own quantized weights"},
    )


# --------------------------------------------------------------------------- profiling
@contextlib.contextmanager
def maybe_torch_profile(path: str | None, label: str) -> Iterator[None]:
    """torch.profiler around one phase; writes ``{path}.{label}.txt``: the op table by self
    time and the share of wall time spent outside any aten op (Python, dispatch, waiting)."""
    if path is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
    wall_us = 1e6 * (time.perf_counter() - t0)
    averages = prof.key_averages()
    in_ops_us = sum(e.self_cpu_time_total for e in averages)
    out = f"{path}.{label}.txt"
    with open(out, "w") as f:
        f.write(f"wall {wall_us / 1e6:.2f} s; inside aten ops (sum of self time) "
                f"{in_ops_us / 1e6:.2f} s = {100 * in_ops_us / wall_us:.1f}%; outside ops "
                f"(python, dispatch, allocator) {100 * (1 - in_ops_us / wall_us):.1f}%\n\n")
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40))
    print(f"  torch.profiler table written to {out}")


# --------------------------------------------------------------------------- machine
def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
        for line in cpuinfo.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                info["avx2"] = "avx2" in flags
                info["avx512f"] = "avx512f" in flags
                info["amx"] = "amx_tile" in flags
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    # OMP_WAIT_POLICY decides whether idle OpenMP threads spin or sleep; on an oversubscribed
    # machine spinning made every step several times slower (see benchmarks/notes/cpu_kernels.md).
    info["env"] = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS",
                                                  "MKL_NUM_THREADS", "GOMP_SPINCOUNT")}
    return info


def code_version() -> dict[str, Any]:
    """HEAD and a digest of uncommitted changes under src/: src/ moves while people work, and
    a figure is only meaningful next to the code that produced it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True,
                                  timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    diff = git("diff", "HEAD", "--", "src")
    return {
        "head": git("rev-parse", "--short", "HEAD").strip(),
        "src_dirty": bool(diff),
        "src_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None,
        "src_dirty_files": git("diff", "--name-only", "HEAD", "--", "src").split(),
    }


def load_average() -> list[float]:
    # The machine is shared: the load average says how disturbed a run was.
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# --------------------------------------------------------------------------- main
def write_json(path: str, results: dict[str, Any], phases: dict[str, PhaseResult]) -> None:
    out = dict(results)
    out["phases"] = {}
    for k, p in phases.items():
        d = p.as_dict()
        d["extra"] = {kk: vv for kk, vv in d["extra"].items() if kk != "token_ids"}
        out["phases"][k] = d
    with open(path, "w") as f:
        json.dump(out, f, indent=2, default=str)


def parse_engine_args(items: Sequence[str]) -> dict[str, Any]:
    args = dict(DEFAULT_ENGINE_ARGS)
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg wants key=value, got {item!r}")
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        elif raw.lower() == "none":
            value = None
        else:
            for conv in (int, float):
                try:
                    value = conv(raw)
                    break
                except ValueError:
                    pass
        args[key.replace("-", "_")] = value
    return args


def ratio(a: PhaseResult | None, b: PhaseResult | None) -> float | None:
    return a.output_tps / b.output_tps if a and b else None


def print_phase(p: PhaseResult) -> None:
    extra = ""
    if p.generated_tokens != p.output_tokens:
        extra = f"  (computed {p.generated_tokens} incl. batch padding; only requested counted)"
    print(
        f"  {p.name:<28} {p.num_requests:>4} req  {p.wall_s:8.1f} s  "
        f"output {p.output_tps:8.1f} tok/s  total {p.total_tps:8.1f} tok/s{extra}"
    )


def single_stream_phase(llm: LLM, args: argparse.Namespace, vocab: list[int]) -> dict[str, Any]:
    """[4] TPOT of one request against the memory roofline, measured back to back."""
    cfg = llm.engine.loaded.config
    print(f"\n[4] single-stream decode: prompt {args.single_prompt_len}, "
          f"{args.single_output_len} output tokens, x{args.single_repeats} ...", flush=True)
    with maybe_torch_profile(args.torch_profile, "single_stream"):
        ss = single_stream(llm, args.single_prompt_len, args.single_output_len,
                           args.single_repeats, vocab, args.seed + 1)
    bw = measure_bandwidth()
    dtype = next(llm.engine.runner.model.parameters()).dtype
    elem = torch.empty((), dtype=dtype).element_size()
    db = decode_bytes(llm.engine.loaded.weights, cfg.num_hidden_layers,
                      cfg.num_key_value_heads, cfg.head_dim, elem)
    # Mean context over the decode: the KV read grows by one token per step.
    mean_ctx = args.single_prompt_len + args.single_output_len / 2
    roof_copy = 1e3 * db.weight_bytes / (bw.copy_gbps * 1e9)
    roof_read = 1e3 * db.weight_bytes / (bw.read_gbps * 1e9)
    roof_kv = 1e3 * (db.weight_bytes + db.kv_bytes(mean_ctx)) / (bw.copy_gbps * 1e9)
    ss.update({
        "dtype": str(dtype),
        "bandwidth": asdict(bw),
        "decode_bytes": {**asdict(db), "weight_bytes": db.weight_bytes,
                         "kv_bytes_at_mean_context": db.kv_bytes(mean_ctx)},
        "roofline_ms_copy_bw": roof_copy,
        "roofline_ms_read_bw": roof_read,
        "roofline_ms_copy_bw_incl_kv": roof_kv,
        "ratio_vs_roofline": ss["tpot_ms_median"] / roof_copy,
        "ratio_best_vs_roofline": ss["tpot_ms_best"] / roof_copy,
        "ratio_vs_read_roofline": ss["tpot_ms_median"] / roof_read,
    })
    mb = 1e-6
    print(f"  TPOT (decode only) median {ss['tpot_ms_median']:.1f} ms, best "
          f"{ss['tpot_ms_best']:.1f} ms; engine decode step median "
          f"{ss['decode_step_ms_median']:.1f} ms  [{dtype}]")
    print(f"  bytes/token: linear {db.linear_bytes * mb:.1f} MB + LM head "
          f"{db.lm_head_bytes * mb:.1f} MB + norms {db.norm_bytes * mb:.3f} MB + embedding "
          f"row {db.embedding_row_bytes * mb:.4f} MB = {db.weight_bytes * mb:.1f} MB "
          f"(+ KV {db.kv_bytes(mean_ctx) * mb:.1f} MB at mean context {mean_ctx:.0f})")
    print(f"  bandwidth: copy {bw.copy_gbps:.2f} GB/s (r+w, {bw.copy_mib} MiB), "
          f"read {bw.read_gbps:.2f} GB/s ({bw.read_by} over {bw.read_mib} MiB), "
          f"best of {bw.repeats}")
    print(f"  roofline: {roof_copy:.1f} ms/token at copy bw ({roof_read:.1f} at read bw; "
          f"{roof_kv:.1f} incl. KV)")
    print(f"  measured / roofline = {ss['ratio_vs_roofline']:.2f} "
          f"(best run {ss['ratio_best_vs_roofline']:.2f}; target <= 1.5)")
    return ss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len-range", type=int, nargs=2, default=[100, 1024],
                    metavar=("MIN", "MAX"))
    ap.add_argument("--output-len-range", type=int, nargs=2, default=[100, 512],
                    metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help=f"tailserve EngineArgs field (repeatable); defaults {DEFAULT_ENGINE_ARGS}")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--hf-num-prompts", type=int, default=None,
                    help="run transformers on the first N requests of the set (default: all)")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--llama-cpp-num-prompts", type=int, default=None)
    ap.add_argument("--skip-single-stream", action="store_true")
    ap.add_argument("--single-prompt-len", type=int, default=128)
    ap.add_argument("--single-output-len", type=int, default=128)
    ap.add_argument("--single-repeats", type=int, default=3)
    ap.add_argument("--progress-s", type=float, default=60.0,
                    help="print tailserve progress this often (0: never)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--json", type=str, default=None, metavar="PATH")
    ap.add_argument("--torch-profile", type=str, default=None, metavar="PREFIX",
                    help="profile the tailserve phases with torch.profiler (slows them down: "
                    "use for the breakdown, not for the figures)")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    results: dict[str, Any] = {"machine": machine_info(), "code": code_version(),
                               "args": vars(args), "load_average_start": load_average()}
    print("machine:", results["machine"])
    print("code:", results["code"])
    print("load average at start:", results["load_average_start"])

    engine_args = parse_engine_args(args.engine_arg)
    results["engine_args"] = engine_args
    t0 = time.perf_counter()
    llm = LLM(keep_checkpoint=True, **engine_args)  # the roofline and transformers read it
    print(f"tailserve loaded in {time.perf_counter() - t0:.1f} s; engine args {engine_args}")
    cfg = llm.engine.loaded.config
    excluded = special_token_ids(llm.tokenizer)
    vocab = [t for t in range(cfg.vocab_size) if t not in excluded]
    reqs = make_requests(args.num_prompts, tuple(args.input_len_range),
                         tuple(args.output_len_range), cfg.vocab_size, excluded, args.seed)
    n_in = sum(len(r.prompt_token_ids) for r in reqs)
    n_out = sum(r.output_len for r in reqs)
    print(f"request set: {len(reqs)} requests, random token ids (vocab {cfg.vocab_size} minus "
          f"{len(excluded)} special/added ids), seed {args.seed}; {n_in} prompt + {n_out} "
          f"output tokens")

    # Warm-up: first-call costs (thread pool, allocator, lazy imports) are not throughput.
    llm.generate([{"prompt_token_ids": vocab[:16]}],
                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))

    phases: dict[str, PhaseResult] = {}

    def save() -> None:
        # After every phase: a run killed half-way (shared machine) still leaves its figures.
        if args.json:
            write_json(args.json, results, phases)

    # Single stream first: it is short, and its roofline wants the quietest minutes of the run.
    if not args.skip_single_stream:
        results["single_stream"] = single_stream_phase(llm, args, vocab)
        save()

    print("\n[1] tailserve LLM.generate, all requests at once ...", flush=True)
    with maybe_torch_profile(args.torch_profile, "batched"):
        phases["tailserve"] = run_tailserve(llm, reqs, progress_s=args.progress_s)
    print_phase(phases["tailserve"])
    steps = phases["tailserve"].extra["steps"]
    print("  steps:", {k: round(v, 3) if isinstance(v, float) else v
                       for k, v in steps.items() if k != "decode_only_by_batch"})
    for k, v in steps.get("decode_only_by_batch", {}).items():
        print(f"    decode-only steps with {k:>5} seqs: {v['steps']:4d} steps, median "
              f"{v['step_ms_median']:7.1f} ms/step, {v['ms_per_seq_median']:6.1f} ms/seq")
    save()

    hf_n = min(args.hf_num_prompts or len(reqs), len(reqs))
    subset = reqs[:hf_n]
    if not args.skip_transformers and hf_n < len(reqs):
        # Same requests for both engines, so the ratio compares like with like.
        print(f"\n[1b] tailserve on the transformers subset (first {hf_n}) ...", flush=True)
        phases["tailserve_subset"] = run_tailserve(
            llm, subset, f"tailserve (first {hf_n})", progress_s=args.progress_s
        )
        print_phase(phases["tailserve_subset"])
        save()

    if not args.skip_transformers:
        print(f"\n[2] transformers generate, batch {args.hf_batch_size}, left padding, greedy, "
              f"{hf_n} requests ...", flush=True)
        dtype = next(llm.engine.runner.model.parameters()).dtype
        model = build_hf_model(llm, dtype)
        pad = llm.tokenizer.pad_token_id
        pad_id = pad if pad is not None else 0
        model.generate(input_ids=torch.tensor([vocab[:8]]), max_new_tokens=2, do_sample=False,
                       pad_token_id=pad_id)  # warm-up
        phases["transformers"] = run_transformers(model, subset, args.hf_batch_size, pad_id)
        print_phase(phases["transformers"])
        ref = phases.get("tailserve_subset", phases["tailserve"])
        agree = greedy_agreement(ref.extra["token_ids"][:hf_n],
                                 phases["transformers"].extra["token_ids"])
        results["greedy_agreement"] = agree
        print("  greedy agreement tailserve vs transformers:", agree)
        del model
        save()

    if not args.skip_llama_cpp:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("\n[3] llama-cpp-python is not installed (no prebuilt CPU wheel could be "
                  "fetched here): skipped")
        else:
            source = llm.engine.loaded.source
            if not source.endswith(".gguf"):
                print("\n[3] llama.cpp needs a .gguf model: skipped")
            else:
                n = min(args.llama_cpp_num_prompts or len(reqs), len(reqs))
                print(f"\n[3] llama.cpp, one request after another, {n} requests ...", flush=True)
                phases["llama_cpp"] = run_llama_cpp(source, reqs[:n], torch.get_num_threads())
                print_phase(phases["llama_cpp"])

    print("\n== summary (output tokens/s = useful output tokens / wall time)")
    for p in phases.values():
        print_phase(p)
    ratios: dict[str, float | None] = {}
    if "transformers" in phases:
        if hf_n < len(reqs):
            print(f"  NOTE: transformers ran only the first {hf_n} of {len(reqs)} requests; "
                  "'tailserve (full set) / transformers' compares different subsets.")
        ratios["tailserve_full_set_over_transformers"] = ratio(
            phases["tailserve"], phases["transformers"])
        if "tailserve_subset" in phases:
            ratios["tailserve_same_subset_over_transformers"] = ratio(
                phases["tailserve_subset"], phases["transformers"])
    if "llama_cpp" in phases:
        ratios["tailserve_over_llama_cpp"] = ratio(phases["tailserve"], phases["llama_cpp"])
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x" + ("  (target >= 5x)" if "transformers" in k else ""))
    results["ratios"] = ratios
    results["load_average_end"] = load_average()
    print("load average at end:", results["load_average_end"])

    save()
    if args.json:
        print("wrote", args.json)

if __name__ == "__main__":
    main()
