# Base image shared by every Temper service: the project and its Python dependencies.
# Build from the repository root:  docker build -f deploy/images/base.Dockerfile -t temper-base .
# Each service's own image (services/<name>/Dockerfile) starts FROM this one and sets its command.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 OMP_NUM_THREADS=1
WORKDIR /opt/temper
RUN apt-get update && apt-get install -y --no-install-recommends make g++ && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md Makefile ./
COPY protos protos
COPY services services
COPY clients clients
COPY deploy/local deploy/local
# torch: the CPU wheel; GPU images (inference, learner) override TORCH_SPEC with a CUDA build
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
RUN pip install ${TORCH_SPEC} \
 && mkdir -p services/v1 && touch services/v1/__init__.py \
 && pip install grpcio-tools==1.85.1 && mkdir -p /tmp/gen \
 && python -m grpc_tools.protoc -I protos --python_out=/tmp/gen --grpc_python_out=/tmp/gen protos/temper/v1/*.proto \
 && cp /tmp/gen/temper/v1/*.py services/v1/ \
 && pip install . opentelemetry-exporter-otlp-proto-grpc
USER 65532:65532
