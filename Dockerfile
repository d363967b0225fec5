# cbserve: the OpenAI-compatible continuous-batching server on CPU torch, with the default chat
# model (SmolLM2-135M-Instruct, GGUF Q4_1) baked in at build time.
#
#   docker build -t cbserve .
#   docker run -p 8000:8000 cbserve                      # serves on http://127.0.0.1:8000
#   docker run -p 8000:8000 cbserve --api-key sekret     # extra flags go to `python -m server`
#
# The install steps live in scripts/docker-install.sh (which runs scripts/install.sh), so the
# tests run the same steps outside Docker.

FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CBSERVE_MODEL_DIR=/opt/models
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scripts/ scripts/
COPY engine/ engine/
COPY models/ models/
COPY server/ server/
COPY clients/ clients/
COPY loadtest/ loadtest/
COPY tools/ tools/
RUN TORCH_INDEX=https://download.pytorch.org/whl/cpu scripts/docker-install.sh /opt/venv

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin cbserve
# The venv's interpreter links to /usr/local/bin/python3.11, the same path in both stages.
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=cbserve:cbserve /opt/models /opt/models
ENV PATH=/opt/venv/bin:$PATH \
    CBSERVE_MODEL_DIR=/opt/models \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1
USER cbserve
WORKDIR /home/cbserve
EXPOSE 8000
# /health is 503 once the engine loop has died or a step is stuck; the start period covers loading.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# SIGTERM (docker stop) stops admission and lets in-flight requests finish for up to 30 s; give
# `docker stop -t 35` to wait for all of it.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "server", "--host", "0.0.0.0", "--port", "8000"]
CMD []
