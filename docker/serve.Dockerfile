# The serving image: `dspark serve` (port 8000) and `dspark profile`.
# Build from the repository root:  docker build -f docker/serve.Dockerfile -t dspark-serve:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HOME=/models/hf

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
 && useradd --uid 10001 --create-home dspark \
 && mkdir -p /models && chown dspark /models

USER 10001
EXPOSE 8000
ENTRYPOINT ["dspark"]
CMD ["serve", "--port", "8000"]
