# syntax=docker/dockerfile:1
# temper-sandbox: runs untrusted code in gVisor (runsc) sandboxes
# Build from the repository root:  docker build -f deploy/images/sandbox.Dockerfile -t temper-sandbox .
# Stage 1 builds a virtualenv with only this service's extra ([sandbox]); stage 2 copies it into a
# slim runtime without compilers or pip caches. `pip install ./clients` generates the protobuf code
# (clients/setup.py runs clients/build_protos.py, the one recipe `make protos` uses too).
FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos protos
COPY clients clients
COPY services services
# the two distributions of this repository (their pins are in the pyproject.toml files), not PyPI names
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ./clients ".[sandbox]"

FROM python:3.11-slim-bookworm
# runsc (gVisor) starts one sandbox per execution; gcc/g++ compile the C and C++ programs it runs
RUN apt-get update \
 && apt-get install -y --no-install-recommends runsc=0.0~20221219.0-2+b3 gcc=4:12.2.0-3 g++=4:12.2.0-3 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 HOME=/tmp
WORKDIR /var/lib/temper
# root, on purpose: runsc needs it to create namespaces, mounts and the cgroup of each sandbox (see
# deploy/k8s/base/sandbox.yaml for the pod security context); untrusted code runs as UID 65534 inside runsc
# hadolint ignore=DL3002
USER 0:0
ENTRYPOINT ["python", "-m", "temper.sandbox"]
