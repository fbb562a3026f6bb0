# The project image: persia_core, components and pipelines with their pinned requirements, WORKDIR at the project
# root (so the default data path data/movielens resolves). Used as every KFP component's base_image, by the
# Vertex AI CustomJob's worker pools (python -m persia_core.cluster) and as Dataflow's sdk_container_image.
#
#   docker build -t persia-kfp:local .                                      CPU torch (PyTorch's CPU index)
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t persia-kfp-cuda .
#                                                                           CUDA torch of the same version
#   docker build --target tfrecord -t persia-kfp-tfrecord .                 TFRecord conversion (requirements-tfrecord.txt)
#
# `make image [CUDA=1] [IMAGE=tag]` runs the first two; cloudbuild.yaml builds and pushes all three. The main image
# also serves predictions: `python -m persia_core serve --host 0.0.0.0` (the container command register-model sets).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS os
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/persia-kfp

# TFRecord conversion: its own environment (tensorflow 2.16 / protobuf < 5 cannot live beside kfp and beam[gcp]).
FROM os AS tfrecord
COPY requirements-tfrecord.txt ./
RUN pip install -r requirements-tfrecord.txt
COPY pyproject.toml README.md ./
COPY persia_core persia_core
COPY components components
COPY pipelines pipelines
RUN pip install --no-deps -e . && python -c "import persia_core.data.tfrecord"

# The main image (the default target: last stage).
FROM os AS main
# torch of the pinned version from PyTorch's own index: the CPU build by default (PyPI's Linux wheel would be the
# multi-GB CUDA one); cloudbuild.yaml / make image CUDA=1 pass a CUDA index for the CUDA image
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
COPY requirements.txt ./
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
      pip install "torch==$(sed -n 's/^torch==//p' requirements.txt)" --index-url "$TORCH_INDEX_URL"; \
    fi \
 && pip install -r requirements.txt
COPY pyproject.toml README.md ./
COPY persia_core persia_core
COPY components components
COPY pipelines pipelines
COPY data data
RUN pip install --no-deps -e . \
 && python -c "import persia_core.cluster, persia_core.train.worker, persia_core.ps.server, components.custom_job, pipelines.vertex"
