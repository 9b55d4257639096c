# cache-indexer image: the indexer (default CMD) and the bridge (args: bridge ...) share it.
# Build stage compiles the optional C accelerators (block hasher, native index and query threads, bulk ZMQ
# receive) into a wheel. The wheel installs one top-level package, cache_indexer (the folders copied below
# become cache_indexer.schemas, cache_indexer.infra, ...: pyproject.toml's package-dir).
FROM python:3.11.11-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY schemas ./schemas
COPY infra ./infra
COPY bridge ./bridge
COPY indexer ./indexer
COPY api ./api
COPY cache_indexer ./cache_indexer
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11.11-slim-bookworm
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl \
 && rm -rf /wheels \
 && python -c "import cache_indexer.schemas._blockhash, cache_indexer.indexer._prefix_walk, cache_indexer.indexer._native_index, cache_indexer.bridge._zmq_drain, cache_indexer.bridge._vllm_decode, cache_indexer.infra._event_unpack, cache_indexer.api._answer_json" \
 && groupadd --system --gid 10001 cache-indexer \
 && useradd --system --uid 10001 --gid 10001 --no-create-home cache-indexer
USER 10001:10001
EXPOSE 28080
ENTRYPOINT ["cache-indexer"]
CMD ["indexer", "--config", "/etc/cache-indexer/config.yaml"]
