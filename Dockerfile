# One image for every service: `microserving shim | router | gateway | up`.
#   docker build -t microserving-grpc .                       # CPU torch (default)
#   docker build -t microserving-grpc:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   --build-arg EXTRAS=[nixl] adds NIXL, the shims' default KV transport where it loads.
FROM python:3.11-slim

# torch comes from this index, pinned to the version pyproject.toml pins; the CPU wheel keeps
# the image small. Everything else comes from the default index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG EXTRAS=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md ./
COPY microserving ./microserving
COPY engine_shim ./engine_shim
COPY router ./router
COPY gateway ./gateway
COPY bench ./bench
RUN pip install ".${EXTRAS}" && useradd --create-home --uid 10001 microserving

USER microserving
# 8000: gateway HTTP; 50051: gRPC of a shim or the router.
EXPOSE 8000 50051
ENTRYPOINT ["microserving"]
CMD ["up", "--host", "0.0.0.0"]
