# GPU image for the speedrun: CUDA 12 runtime from NVIDIA, Python 3.12, the project's pinned requirements. The pinned
# torch (2.13.0) brings its own CUDA 13.0 libraries, so the host's NVIDIA driver must be 580 or newer; run.sh
# says so in one line when it is older (docs/supported-torch.md).
#   docker build -t gpt2-speedrun .
#   docker run --gpus all --ipc=host -v "$PWD/data/fineweb10B:/speedrun/data/fineweb10B" \
#       -v "$PWD/logs:/speedrun/logs" gpt2-speedrun
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH

# gcc and the Python headers: Triton compiles a small launcher when FlexAttention is compiled.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc git \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /speedrun
COPY requirements.txt .
RUN pip install -r requirements.txt
COPY . .

# Shards and run logs live outside the image.
VOLUME ["/speedrun/data/fineweb10B", "/speedrun/logs"]
CMD ["./run.sh"]
