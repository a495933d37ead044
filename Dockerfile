# The image `coral deploy` names (coral:0.1.0 by default; --image and --gateway-image take another): the coral
# CLI with the Coral engine's extras, for the gateway (`coral gateway`), the runtime (`coral serve`) and the Coral
# engine's schedulers and nodes.
#
#   docker build -t coral:0.1.0 .                                  # CPU torch (gateway, CPU nodes, tests)
#   docker build --build-arg TORCH=cuda -t coral:0.1.0-cuda .      # CUDA torch (GPU nodes)
#   docker build --build-arg EXTRAS=engine,ray -t coral:0.1.0 .    # with Ray, for --target kuberay
#
# TORCH picks the base: `cpu` is python:3.11-slim with torch's CPU wheel, `cuda` the PyTorch CUDA runtime image
# (torch and CUDA already there). EXTRAS are the pip extras installed with coral (pyproject.toml).

ARG TORCH=cpu

FROM python:3.11-slim-bookworm AS torch-cpu
ARG TORCH_VERSION=2.5.1
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"

FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime AS torch-cuda

# the stage named by TORCH, tagged above (hadolint cannot see through the argument)
# hadolint ignore=DL3006
FROM torch-${TORCH}
ARG EXTRAS=engine
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/coral
COPY pyproject.toml README.md ./
COPY coral ./coral
# coral itself, from this tree; torch is already installed (the base's build), so the extras keep it; the other
# dependencies are pyproject.toml's ranges
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[${EXTRAS}]" \
    && useradd --create-home --uid 10001 --user-group coral

USER 10001:10001
WORKDIR /home/coral
ENV CORAL_HOME=/home/coral/.coral
# 8080: coral gateway / coral serve; 8000: a Coral engine instance's OpenAI API
EXPOSE 8080 8000
ENTRYPOINT ["coral"]
CMD ["--help"]
