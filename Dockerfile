# agentgate: one image for every role (gateway, worker, key generation); compose.yaml picks the
# role with the command. CPU build of PyTorch: the image runs the demo model and the sim backend
# anywhere; a GPU worker image would install a CUDA build of the same torch version instead.
#
#   docker build -t agentgate:latest .
#   docker run --rm agentgate:latest serve -h
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# NOTE: torch first, pinned, from the CPU index (as scripts/run does): resolving pyproject's range
# from PyPI would pull a multi-GB CUDA build. Never torchvision.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# NOTE: only what `pip install .` packages (pyproject: engine, gateway, sessions, encoders,
# replay; README.md is the package's readme), so edits to tests or deploy/ keep this layer cached.
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY gateway /src/gateway
COPY sessions /src/sessions
COPY encoders /src/encoders
COPY replay /src/replay
RUN pip install /src && rm -rf /src

# The demo model, written at build time: `agentgate model init` is deterministic, so every
# container of this image (gateway and workers) has the same files. It writes them 0600 / 0700,
# hence the chmod: readable by the runtime user, writable by nobody but root.
RUN agentgate model init /opt/agentgate/models/demo-model \
    && chmod -R a+rX /opt/agentgate/models

# A non-root user. /keys (the CURVE key pairs) and /var/lib/agentgate (the tenant secret) are
# created here, owned by that user, because Docker initialises an empty named volume from the
# image's directory at the mount point, ownership and mode included: the volumes compose.yaml
# mounts there are then writable by this user. ~/.cache/agentgate/demo-model points at the
# built-in model, so a bare `agentgate serve` / `generate` finds it instead of writing a copy.
RUN groupadd --system --gid 10001 agentgate \
    && useradd --system --uid 10001 --gid agentgate --create-home --home-dir /home/agentgate \
        --shell /usr/sbin/nologin agentgate \
    && install -d -o agentgate -g agentgate -m 0700 /keys /var/lib/agentgate \
        /home/agentgate/.cache /home/agentgate/.cache/agentgate \
    && ln -s /opt/agentgate/models/demo-model /home/agentgate/.cache/agentgate/demo-model

USER 10001:10001
WORKDIR /home/agentgate
# gateway HTTP; a worker's requests, events and event replay (compose.yaml's ports)
EXPOSE 8000 5555 5556 5557
ENTRYPOINT ["agentgate"]
CMD ["--help"]
