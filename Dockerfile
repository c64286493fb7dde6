# pulsesync: publisher, subscriber and retention worker in one image (CPU torch; the weights it
# moves are bytes, the GPU belongs to the engine next to it).
#   docker build -t pulsesync .
#   docker run --rm pulsesync demo        # the whole protocol inside the container, no server
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /src
# torch from PyTorch's CPU index first, so the install below does not pull CUDA wheels.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY pulsesync ./pulsesync
RUN pip install ".[demo]" && rm -rf /src
COPY configs /etc/pulsesync

RUN useradd --uid 1000 --create-home pulsesync && mkdir -p /keys /weights /cache && chown pulsesync /keys /weights /cache
USER pulsesync
WORKDIR /home/pulsesync
ENTRYPOINT ["pulsesync"]
CMD ["--help"]
