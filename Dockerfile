# The fmstore image the Kubernetes manifests run (deploy/kubernetes/daemonset.yaml).
# Build it from the repository root:
#
#   docker build -t ghcr.io/example/fmstore:0.1.0 .
#
# fmstore is installed with pip from this source tree, over the CPU build of torch (the
# daemon moves bytes; it needs no CUDA, and the CPU wheels are a fraction of the size).
# It runs as root: the daemon works on the node's hostPath volumes (NVMe, Lustre, the
# catalog under /var/lib/fmstore), whose files the training pods write.
FROM python:3.11-slim

LABEL org.opencontainers.image.title="fmstore" \
      org.opencontainers.image.source="https://github.com/example/fmstore" \
      io.fmstore.image="ghcr.io/example/fmstore:0.1.0"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# torch first, from the PyTorch CPU index, at the version constraints.txt pins; the
# constraints then keep pip from replacing it with a CUDA build.
COPY constraints.txt ./
RUN pip install --index-url https://download.pytorch.org/whl/cpu \
        "$(grep -E '^torch==' constraints.txt)"
COPY pyproject.toml README.md ./
COPY fmstore ./fmstore
RUN pip install --constraint constraints.txt . \
    && rm -rf /src

WORKDIR /
ENTRYPOINT ["fmstore"]
CMD ["daemon", "--config", "/etc/fmstore/fmstore.toml"]
