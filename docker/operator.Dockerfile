# The operator image: kopf + the Kubernetes client, no torch.
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t dspark-operator:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY operator ./operator
RUN pip install ".[operator]" \
 && groupadd --gid 10001 dspark && useradd --uid 10001 --gid 10001 --no-create-home dspark

# Numeric, so that the kubelet can check runAsNonRoot without the image's passwd.
USER 10001:10001
EXPOSE 8080 8081
CMD ["python", "-m", "dspark_operator"]
