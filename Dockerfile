# Two images from one file, both running the `microserving` entry point as a non-root user:
#   docker build --target control-plane -t microserving-grpc-control-plane .   # gateway, router: no torch
#   docker build -t microserving-grpc .                                        # engine shims (CPU torch)
#   docker build -t microserving-grpc:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   --build-arg EXTRAS=engine,nixl adds NIXL, the shims' default KV transport where it loads.
# BASE_IMAGE lets a machine without registry access build on a locally made image
# (scripts/compose_smoke.sh, docs/deploy.md).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS source
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
RUN useradd --create-home --uid 10001 microserving
COPY pyproject.toml README.md ./
COPY microserving ./microserving
COPY engine_shim ./engine_shim
COPY router ./router
COPY gateway ./gateway
COPY colocated ./colocated
COPY bench ./bench

# The gateway and the router: the package without extras (no torch, numpy or matplotlib).
FROM source AS control-plane
RUN pip install . && rm -rf /root/.cache
USER 10001
EXPOSE 8000 50051 9100
ENTRYPOINT ["microserving"]
CMD ["gateway", "--host", "0.0.0.0"]

# The engine shim (and `microserving up`): torch from its own index, pinned as pyproject pins
# it; the CPU wheel keeps the image small.
FROM source AS engine
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG EXTRAS=engine
# A folder of wheels mounted into the build (podman build -v DIR:/wheels): pip looks there too.
ARG PIP_FIND_LINKS
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && pip install ".[${EXTRAS}]" && rm -rf /root/.cache
USER 10001
# 8000: gateway HTTP (up); 50051: gRPC of a shim; 9100: /metrics.
EXPOSE 8000 50051 9100
ENTRYPOINT ["microserving"]
CMD ["up", "--host", "0.0.0.0"]
