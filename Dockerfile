# shardserve on CPU: a Ray head and the gateway + model servers in one container (docker-compose.yml).
# The default model is trained on first start into the `models` volume (about 3 minutes on 2 cores);
# later starts reuse it. GPU images: start from an nvidia/cuda base and install torch's CUDA wheel.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
# torch first, from PyTorch's CPU index (the default index pulls CUDA wheels, GBs)
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY engines engines
COPY training training
COPY serving serving
COPY tuner tuner
COPY loadtest loadtest
COPY deploy deploy
COPY shardserve shardserve
COPY recipes recipes
RUN pip install -e . && useradd --create-home --uid 1000 shardserve \
    && mkdir -p /app/models /app/data /app/runs && chown -R shardserve /app/models /app/data /app/runs
USER shardserve

EXPOSE 8000 6379 8265
ENTRYPOINT ["/app/deploy/docker/entrypoint.sh"]
