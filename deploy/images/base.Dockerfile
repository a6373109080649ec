# Base image shared by every Temper service: the project and its Python dependencies.
# Build from the repository root:  docker build -f deploy/images/base.Dockerfile -t temper-base .
# Each service's own image (services/<name>/Dockerfile) starts FROM this one and sets its command.
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 OMP_NUM_THREADS=1
WORKDIR /opt/temper
RUN apt-get update && apt-get install -y --no-install-recommends make g++ && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY protos protos
COPY clients clients
COPY services services
# torch: the CPU wheel; GPU images (inference, learner) override TORCH_SPEC with a CUDA build
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# the client package's build generates the protobuf code (clients/build_protos.py, as `make protos` does)
RUN pip install ${TORCH_SPEC} \
 && pip install ./clients \
 && pip install '.[all]' opentelemetry-exporter-otlp-proto-grpc
USER 65532:65532
