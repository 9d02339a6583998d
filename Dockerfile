# syntax=docker/dockerfile:1
# One image for the three cronbus services and the `cronbus` command.
#   docker build -t cronbus:dev .
#   docker run --rm cronbus:dev migrate                                   # cronbus migrate
#   docker run --rm --entrypoint python cronbus:dev -m services.executor  # one service

ARG PYTHON_IMAGE=python:3.11-slim

# --- builder: build the wheel, install it with its dependencies into /opt/venv -------------
FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A compiler stays in this stage, for a dependency without a wheel for the build platform.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN pip install build \
    && python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY lua ./lua
COPY shared ./shared
COPY services ./services
COPY cronbus ./cronbus
RUN python -m build --wheel --outdir /dist . \
    && /opt/venv/bin/pip install /dist/*.whl \
    && /opt/venv/bin/python -m compileall -q /opt/venv/lib

# --- runtime: the venv and nothing else, as an unprivileged user ----------------------------
FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 cronbus \
    && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home \
       --shell /usr/sbin/nologin cronbus
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONFAULTHANDLER=1 \
    HOME=/tmp
# Nothing is written outside /tmp (an emptyDir in Kubernetes, where the root file system is
# read-only). The working directory holds no sources: the installed package is what runs.
WORKDIR /
USER 10001:10001
# /metrics, /healthz and /readyz of the dispatcher, executor and sweeper (CRONBUS_METRICS_PORT).
EXPOSE 9101 9102 9103
ENTRYPOINT ["cronbus"]
CMD ["--help"]
