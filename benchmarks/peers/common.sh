# Shared settings for the peer scripts (sourced, not run). Everything a peer installs lives
# under PEERS_HOME, never in the project's .venv and never in the repository.
PEERS_HOME="${TAILSERVE_PEERS_HOME:-$HOME/.cache/tailserve-peers}"
VLLM_VENV="$PEERS_HOME/vllm"
VLLM_VERSION=0.32.0
LLAMA_VERSION=11434.0.0
LLAMA_SRC="$PEERS_HOME/llama.cpp"
LLAMA_BIN="$LLAMA_SRC/build/bin"
# MODEL_HF / PEERS_SERVED_NAME: another model (serving_peers.py --model-hf / --served-name).
HF_FOLDER="${MODEL_HF:-$PEERS_HOME/smollm2-hf}"
SERVED_NAME="${PEERS_SERVED_NAME:-SmolLM2-135M-Instruct}"
# Builds share the machine with other work: lowest priority, and -j from the caller (default 1).
NICE="nice -n 19"
JOBS="${PEERS_JOBS:-1}"
mkdir -p "$PEERS_HOME"
