# The serving image: `dspark serve` (port 8000) and `dspark profile`.
# Build from the repository root:  docker build -f docker/serve.Dockerfile -t dspark-serve:0.1.0 .
# Locked down as in a pod:  docker run --read-only --tmpfs /tmp --tmpfs /var/cache/dspark --cap-drop ALL \
#   --security-opt no-new-privileges -p 8000:8000 dspark-serve:0.1.0 serve --host 0.0.0.0 --port 8000
FROM python:3.11-slim

# Every cache under /var/cache/dspark, so the image runs on a read-only root filesystem with
# /var/cache/dspark and /tmp writable (the operator's pods mount emptyDirs there and set the same).
# HOME too: ray.init writes its auth token to ~/.ray and fails where it cannot.
# DSPARK_HOST: the server must be reachable through a published port (docker run -p), not only on
# the container's own loopback (the default outside containers).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HOME=/var/cache/dspark/home \
    DSPARK_HOME=/var/cache/dspark/dspark \
    HF_HOME=/var/cache/dspark/huggingface \
    XDG_CACHE_HOME=/var/cache/dspark \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/dspark/torchinductor \
    TORCH_EXTENSIONS_DIR=/var/cache/dspark/torch_extensions \
    TRITON_CACHE_DIR=/var/cache/dspark/triton \
    CUDA_CACHE_PATH=/var/cache/dspark/nv \
    DSPARK_HOST=0.0.0.0

WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY operator ./operator
# g++ builds inductor's CPU graphs and the CPU attention kernel at start-up (without it the engine
# falls back to eager PyTorch, slower); Triton's launchers on the GPU need a C compiler too.
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
# PyPI's Linux torch wheels bundle the CUDA runtime; the node provides the driver.
RUN pip install ".[service]" \
 && groupadd --gid 10001 dspark && useradd --uid 10001 --gid 10001 --create-home dspark \
 && mkdir -p /models /var/cache/dspark && chown 10001:10001 /models /var/cache/dspark

# Numeric, so that the kubelet can check runAsNonRoot without the image's passwd.
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["dspark"]
CMD ["serve", "--port", "8000"]
