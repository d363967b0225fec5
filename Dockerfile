# cbserve: the OpenAI-compatible continuous-batching server on CPU torch, with the default chat
# model (SmolLM2-135M-Instruct, GGUF Q4_1) and its converted tokenizer baked in at build time.
#
#   docker build -t cbserve .
#   docker run -p 8000:8000 cbserve                      # serves on http://127.0.0.1:8000
#   docker run -p 8000:8000 cbserve --api-key sekret     # extra flags go to `python -m server`
#
# Build arguments (all optional):
#   TORCH_INDEX    where torch's CPU wheel comes from (default PyTorch's CPU index); a mirror or a
#                  local PEP 503 index works too. Other packages come from pip's usual index.
#   TORCH_VERSION  torch release (default 2.13.0; on x86_64 the +cpu build is pinned)
#   PIP_OPTIONS    extra options for every pip install, e.g. "--trusted-host 10.0.0.5" for a plain
#                  HTTP index, or "--index-url https://mirror/simple" for a PyPI mirror
#   STRIP          1 (default): strip the static symbol tables of torch's libraries (~90 MB)
#
#   docker build --network host \
#     --build-arg TORCH_INDEX=http://127.0.0.1:8701/simple \
#     --build-arg PIP_OPTIONS="--trusted-host 127.0.0.1" -t cbserve .
#
# The install steps live in scripts/docker-install.sh (which runs scripts/install.sh), so the
# tests run the same steps outside Docker. Only /opt/venv, /opt/models and /opt/kernels leave the build stage:
# no compiler, binutils, pip cache or sources in the final image.

FROM python:3.11-slim AS build
ARG STRIP=1
# g++ compiles the CPU kernels (models/csrc) into /opt/kernels; binutils strips torch.
RUN apt-get update && apt-get install -y --no-install-recommends g++ binutils \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    CBSERVE_MODEL_DIR=/opt/models \
    CBSERVE_KERNEL_DIR=/opt/kernels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scripts/ scripts/
COPY engine/ engine/
COPY models/ models/
COPY server/ server/
COPY clients/ clients/
COPY loadtest/ loadtest/
COPY tools/ tools/
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG PIP_OPTIONS=
RUN TORCH_INDEX="$TORCH_INDEX" TORCH_VERSION="$TORCH_VERSION" PIP_OPTIONS="$PIP_OPTIONS" \
    STRIP="$STRIP" scripts/docker-install.sh /opt/venv

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin cbserve
# The venv's interpreter links to the base image's python, the same path in both stages.
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=cbserve:cbserve /opt/models /opt/models
# Built for x86-64-v3 (AVX2, FMA, F16C): runs on any such CPU, not only the build machine's.
COPY --from=build /opt/kernels /opt/kernels
# The venv is root's and read-only to the server: it never writes byte-code at start (the modules
# a start imports were compiled at build time), so nothing lands in the container's layer.
ENV PATH=/opt/venv/bin:$PATH \
    CBSERVE_MODEL_DIR=/opt/models \
    CBSERVE_KERNEL_DIR=/opt/kernels \
    HF_HUB_OFFLINE=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER cbserve
WORKDIR /home/cbserve
EXPOSE 8000
# /health is 503 once the engine loop has died or a step is stuck; the start period covers loading.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# SIGTERM (docker stop) stops admission and lets in-flight requests finish for up to 7 s
# (--shutdown-timeout), inside Docker's default 10 s grace; then open streams get an error event
# and [DONE], and the process exits without waiting for an engine step still running (measured
# with streams open and the 8 s drain of the time, 2026-12-01: `docker stop` returned in
# 8.4-9.3 s, exit code 0, no SIGKILL; 7 s leaves more room on a slower host).
# A longer drain needs a longer grace: --shutdown-timeout 30 with --stop-timeout 35.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "server", "--host", "0.0.0.0", "--port", "8000"]
CMD []
