# hvdp on GPU clusters: CUDA + cuDNN + NCCL, Open MPI, CUDA builds of torch and TensorFlow,
# Horovod 0.28.1 with NCCL GPU operations built by `python -m hvdp install-horovod --gpu` (the one
# recipe: `make setup` runs it too, and `make nccl-build` rehearses this build without a GPU),
# hvdp, and the sshd `horovodrun -H` needs
# (scripts/ssh_node.sh, the set-up tests/parallel/test_multihost.py runs).
#
#   docker build -t hvdp:gpu .
#   docker run --gpus all --network host -v $PWD/cluster_key:/home/hvdp/.ssh/id_ed25519:ro \
#       -v $PWD/cluster_key.pub:/home/hvdp/.ssh/id_ed25519.pub:ro hvdp:gpu     # on each node
# README.md "Clusters" has the launch commands. Needs an NVIDIA driver for CUDA 13 (>= 580).
#
# Two Python environments, one per framework: torch 2.13 (CUDA 13) and TensorFlow 2.21 (CUDA 12)
# each install NVIDIA library wheels to the same paths (site-packages/nvidia/cudnn, .../nccl), so
# in one environment the second would overwrite the first's cuDNN and NCCL. Each gets Horovod
# built against its own CUDA major: torch with the base image's CUDA 13, TensorFlow with CUDA 12.9.
FROM nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04

ARG DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu's archive drops a package version once an update supersedes it, so exact apt pins break
# rebuilds; the base image tag pins the release (24.04) and the CUDA 12.9 packages are versioned
# by name. The distribution's host keys are deleted: each node makes its own at start.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-dev python3-venv \
        openmpi-bin libopenmpi-dev \
        openssh-server openssh-client \
        cmake g++ make \
        cuda-nvcc-12-9 cuda-cudart-dev-12-9 \
    && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_*

# Pins: the project's (requirements/deps.txt: torch 2.13.0, TF 2.21.0), the rest as resolved
# together with them for Python 3.12.
ARG TORCH_VERSION=2.13.0
ARG TF_VERSION=2.21.0
ARG KERAS_VERSION=3.15.1
ARG COMMON_PINS="numpy==2.4.6 psutil==7.2.2 cloudpickle==3.1.3 PyYAML==6.0.4 packaging==26.4 \
setuptools==80.10.2 wheel==0.48.0 scikit-learn==1.9.1 tqdm==4.70.1"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# COMMON_PINS is a list of requirements: its word splitting is intended
# hadolint ignore=SC2086
RUN python3 -m venv /opt/hvdp/torch \
    && /opt/hvdp/torch/bin/pip install "torch==${TORCH_VERSION}" ${COMMON_PINS}
# hadolint ignore=SC2086
RUN python3 -m venv /opt/hvdp/tensorflow \
    && /opt/hvdp/tensorflow/bin/pip install "tensorflow[and-cuda]==${TF_VERSION}" \
        "keras==${KERAS_VERSION}" ${COMMON_PINS}

# hvdp itself (both environments), then Horovod, once per environment, by hvdp's installer: it
# picks the toolkit whose CUDA major matches the framework's and the NCCL wheel the framework
# itself loads (CUDA 13 for torch, the 12.9 packages above for TensorFlow).
COPY setup.cfg pyproject.toml README.md /opt/hvdp/src/
COPY hvdp /opt/hvdp/src/hvdp
COPY adapters /opt/hvdp/src/adapters
COPY examples /opt/hvdp/src/examples
COPY scripts/ssh_node.sh /opt/hvdp/src/scripts/
RUN for fw in torch tensorflow; do \
        py=/opt/hvdp/$fw/bin/python \
        && "$py" -m pip install --no-deps --no-build-isolation /opt/hvdp/src \
        && "$py" -m hvdp install-horovod --gpu --no-check --cache-dir /tmp/hvdp-wheels \
        && rm -rf /tmp/hvdp-wheels || exit 1; \
    done \
    && rm -rf /opt/hvdp/src/build /opt/hvdp/src/*.egg-info \
    # TensorFlow does not load NCCL itself; Horovod's TF ops find its CUDA 12 NCCL here. torch
    # processes are unaffected: torch loads its own NCCL (RUNPATH) before Horovod's library.
    && nccl_lib=$(/opt/hvdp/tensorflow/bin/python -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))') \
    && test -e "$nccl_lib/libnccl.so.2" \
    && echo "$nccl_lib" > /etc/ld.so.conf.d/hvdp-tensorflow-nccl.conf \
    && ldconfig

# A non-root user; ubuntu images ship "ubuntu" at uid 1000, which the usual uid needs back. The
# cluster key mounted into ~/.ssh must be readable by HVDP_UID (build with the host's uid, or
# chown the key files to it).
# ssh client defaults for launches between nodes: the cluster port, no prompt, and a node's
# per-container host key trusted on first use (a private cluster network).
ARG HVDP_UID=1000
ARG HVDP_SSH_PORT=2222
ENV HVDP_SSH_PORT=${HVDP_SSH_PORT}
RUN (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --no-log-init --create-home --uid "${HVDP_UID}" --shell /bin/bash hvdp \
    && install -d -m 700 -o hvdp -g hvdp /home/hvdp/.ssh \
    && printf 'Host *\n    Port %s\n    StrictHostKeyChecking accept-new\n    BatchMode yes\n    ServerAliveInterval 30\n' \
        "${HVDP_SSH_PORT}" > /home/hvdp/.ssh/config \
    && chown hvdp:hvdp /home/hvdp/.ssh/config && chmod 600 /home/hvdp/.ssh/config

ENV PATH=/opt/hvdp/torch/bin:${PATH} \
    OMP_NUM_THREADS=1
# numeric, so that a host's runtime (and Kubernetes runAsNonRoot) can tell it is not root
USER ${HVDP_UID}
WORKDIR /home/hvdp
EXPOSE ${HVDP_SSH_PORT}
# Each node: its sshd (key-only, this user, port HVDP_SSH_PORT), then the command. Workers keep
# the default and wait; the launching node runs horovodrun (README "Clusters").
ENTRYPOINT ["bash", "/opt/hvdp/src/scripts/ssh_node.sh", "run"]
CMD ["sleep", "infinity"]
