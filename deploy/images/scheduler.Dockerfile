# syntax=docker/dockerfile:1
# temper-scheduler: jobs: task domains -> inference -> rollouts
# Build from the repository root:  docker build -f deploy/images/scheduler.Dockerfile -t temper-scheduler .
# Stage 1 builds a virtualenv with only this service's extra ([scheduler]); stage 2 copies it into a
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
RUN pip install --no-cache-dir ./clients ".[scheduler]"

FROM python:3.11-slim-bookworm
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 HOME=/tmp
WORKDIR /var/lib/temper
# non-root: any UID works (the pod sets runAsUser); data lives on mounted volumes
USER 65532:65532
ENTRYPOINT ["python", "-m", "temper.scheduler"]
