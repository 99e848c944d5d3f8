"""Real sizes, measured: tailserve against llama-server and vLLM-CPU on Llama 3.x shapes.

Writes a synthetic checkpoint with the published shape of Llama-3.2-1B, Llama-3.2-3B or
Llama-3.1-8B (random weights: real_sizes_write.py says why they time like trained ones and
what differs) and runs benchmarks/serving_peers.py on it:

  single      one request at a time, 256-token prompts, 64 outputs: TPOT against the
              stored-bytes roofline (tailserve and llama-server read the same GGUF)
  saturated   32 in flight (fewer requests than the bundled model's run: a 8B step is long)
  prompt256 / prompt2000   TTFT of a 256- and a 2,000-token prompt, one at a time

Every request sends ignore_eos, so the timings are real timings: the output lengths are the
asked ones whatever the random weights sample.

    python benchmarks/real_sizes.py --shape llama-3.2-1b --qtype Q4_0      # a quiet host
    python benchmarks/real_sizes.py --shape llama-3.2-1b --qtype Q4_0 --smoke \\
        --servers tailserve,llama.cpp                                     # the plumbing

Files go to --out (default ~/.cache/tailserve-real-sizes) and are reused by later runs:
``{shape}-{qtype}.gguf``, ``{shape}-hf/`` (config.json and the tokenizer; the bf16 weights
only when vLLM runs). vLLM is left out for the 8B unless --vllm: its bf16 folder is 16 GB on disk
and vLLM holds it in memory (plus its K/V space) on a 24 GiB host beside the others' files.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "src"))
if HERE not in sys.path:
    sys.path.append(HERE)

import real_sizes_write as rw  # noqa: E402

WORKLOADS = "single,saturated,prompt256,prompt2000"
# A full batch once (32 in flight) instead of serving_peers' 64 requests: the 8B's steps
# with 32 sequences take seconds on 2 cores.
PROMPTS = ("saturated=32",)
# vLLM sizes its K/V for the config's 131,072 positions otherwise, more than
# VLLM_CPU_KVCACHE_SPACE holds; the longest request here is 2,008 tokens.
VLLM_ARGS = ("--max-model-len=4096",)
# tailserve alike: a 131,072-token sequence must fit its K/V pool or the engine refuses to
# start. 4 GiB of K/V holds the saturated batch (32 x 320 tokens) of the 8B in float32
# (256 KiB a token) without preemption; llama-server's -c 32768 holds it too.
TAILSERVE_ARGS = ("--max-model-len=4096", "--kv-cache-memory=4")


def log(msg: str) -> None:
    print(f"[real_sizes {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def atomic(path: str) -> str:
    """A temporary name beside ``path``: a file under the final name is always complete,
    so the cache can trust any file it finds."""
    return path + ".partial"


def ensure_gguf(s: rw.Shape, qtype: str, out: str, seed: int, llama_quantize: str) -> str:
    path = os.path.join(out, f"{s.name}-{qtype}.gguf")
    if os.path.isfile(path):
        log(f"reusing {path}")
        return path
    t0 = time.monotonic()
    if qtype == "Q4_K_M":
        src = ensure_gguf(s, "Q8_0", out, seed, llama_quantize)
        log(f"llama-quantize {src} -> {qtype}")
        rw.requantize(llama_quantize, src, atomic(path), qtype, os.cpu_count() or 1)
    else:
        log(f"writing {path} (random weights, gguf's {qtype} quantizer)")
        rw.write_gguf(s, qtype, atomic(path), seed)
    os.replace(atomic(path), path)
    log(f"{path}: {os.path.getsize(path) / 1e9:.2f} GB in {time.monotonic() - t0:.0f} s")
    return path


def ensure_hf(s: rw.Shape, gguf_path: str, out: str, seed: int, weights: bool) -> str:
    """The HF folder: config.json and the tokenizer always (the clients need them), the bf16
    weights when ``weights`` (vLLM)."""
    folder = os.path.join(out, f"{s.name}-hf")
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        log(f"writing the tokenizer to {folder}")
        rw.write_tokenizer(gguf_path, folder)
    rw.write_hf_config(s, folder)  # small: always rewritten, so it follows the code
    if weights and not os.path.isfile(os.path.join(folder, "model.safetensors.index.json")):
        t0 = time.monotonic()
        log(f"writing bf16 safetensors to {folder}")
        rw.write_hf_weights(s, folder, seed)
        log(f"{folder}: written in {time.monotonic() - t0:.0f} s")
    return folder


def check_plan(gguf_path: str) -> None:
    """`tailserve plan` reads the file's config and counts its bytes as the roofline will."""
    subprocess.run([sys.executable, "-m", "tailserve.cli", "plan", gguf_path, "--context",
                    "256"], check=True, env=dict(os.environ, PYTHONPATH=os.path.join(REPO, "src")))


def peers_argv(a: argparse.Namespace, gguf_path: str, hf: str, servers: list[str]) -> list[str]:
    """serving_peers.py's arguments for this model (tested in tests/test_serving_peers.py)."""
    name = f"{a.shape}-{a.qtype}"
    argv = ["--servers", ",".join(servers), "--workloads", a.workloads,
            "--model-gguf", gguf_path, "--tokenizer", hf, "--served-name", name,
            "--json", a.json or os.path.join(a.out, f"{name}.json"),
            "--client", a.client]
    if not a.smoke:  # --prompts would override the smoke run's counts
        argv += [f"--prompts={p}" for p in PROMPTS]
    argv += [f"--tailserve-arg={x}" for x in TAILSERVE_ARGS]
    if "vllm" in servers:
        argv += ["--model-hf", hf, *[f"--vllm-arg={x}" for x in VLLM_ARGS]]
    if a.smoke:
        argv.append("--smoke")
    if a.llama_threads is not None:
        argv += ["--llama-threads", str(a.llama_threads)]
    if a.out_dir is not None:
        argv += ["--out-dir", a.out_dir]
    return argv + a.peers_arg


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(rw.SHAPES), required=True)
    p.add_argument("--qtype", choices=rw.QTYPES, required=True)
    p.add_argument("--out", default=os.path.expanduser("~/.cache/tailserve-real-sizes"),
                   help="where the checkpoints are written and reused (default: %(default)s)")
    p.add_argument("--servers", default="tailserve,llama.cpp,vllm",
                   help="comma-separated (default: %(default)s; vLLM left out for the 8B "
                   "unless --vllm)")
    p.add_argument("--vllm", action="store_true",
                   help="run vLLM (and write its 16 GB bf16 folder) for the 8B too")
    p.add_argument("--workloads", default=WORKLOADS, help="default: %(default)s")
    p.add_argument("--client", choices=("vllm", "tailserve"), default="tailserve",
                   help="the load generator (default: %(default)s: needs no peer)")
    p.add_argument("--smoke", action="store_true", help="a request or two per workload")
    p.add_argument("--write-only", action="store_true", help="write the files, run nothing")
    p.add_argument("--seed", type=int, default=0, help="of the random weights")
    p.add_argument("--llama-threads", type=int, default=None)
    p.add_argument("--peers-home", default=os.path.expanduser("~/.cache/tailserve-peers"))
    p.add_argument("--json", default=None, help="the report (default: OUT/SHAPE-QTYPE.json)")
    p.add_argument("--out-dir", default=None, help="serving_peers' raw results and logs")
    p.add_argument("--peers-arg", action="append", default=[], metavar="ARG",
                   help="an extra serving_peers.py argument (repeatable)")
    a = p.parse_args(argv)
    a.servers = [x.strip() for x in a.servers.split(",") if x.strip()]
    if a.shape == "llama-3.1-8b" and "vllm" in a.servers and not a.vllm:
        log("vLLM left out for the 8B (its bf16 folder is 16 GB; --vllm forces it)")
        a.servers.remove("vllm")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    s = rw.SHAPES[a.shape]
    llama_quantize = os.path.join(a.peers_home, "llama.cpp", "build", "bin", "llama-quantize")
    gguf_path = ensure_gguf(s, a.qtype, a.out, a.seed, llama_quantize)
    hf = ensure_hf(s, gguf_path, a.out, a.seed, weights="vllm" in a.servers)
    check_plan(gguf_path)
    if a.write_only:
        return 0
    import serving_peers

    argv_peers = peers_argv(a, gguf_path, hf, a.servers)
    log("serving_peers.py " + " ".join(argv_peers))
    return serving_peers.main(argv_peers)


if __name__ == "__main__":
    sys.exit(main())
