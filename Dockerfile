# rlgate's service images. Two targets:
#   cpu      the gateway (with the reward webhook) and the rq reward worker: light, no torch
#   learner  the learner on a GPU: torch (PyPI's CUDA wheels bring their CUDA runtime), transformers,
#            peft, DeepSpeed and OpenRLHF (installed without its own requirements: vLLM and flash-attn
#            are not needed by the learner; see learner/_openrlhf.py)
# Built and used by docker-compose.yml. Not built on the machine this was written on (no Docker engine).

FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY episodes ./episodes
COPY gateway ./gateway
COPY reward_hooks ./reward_hooks
COPY learner ./learner
COPY inference ./inference
COPY demo ./demo
COPY rlgate ./rlgate

FROM base AS cpu
RUN pip install . && useradd --create-home rlgate
USER rlgate
EXPOSE 8100
CMD ["rlgate", "gateway", "--host", "0.0.0.0"]

FROM base AS learner
RUN pip install '.[learner]' && pip install --no-deps openrlhf==0.11.2
CMD ["rlgate", "learner"]
