"""The Horovod build recipe's decisions, from facts written by hand (no build, no framework)."""
import json
import os

import pytest

from hvdp.install import build
from hvdp.install.facts import Facts, Framework, Toolkit
from hvdp.install.recipe import InstallError, apply_patch, decide, patches

SDIST_LINES = {  # the lines of Horovod 0.28.1's sources that the patches rewrite
    "CMakeLists.txt": "project(horovod CXX)\nset(CMAKE_CXX_STANDARD 14)\n",
    "horovod/torch/CMakeLists.txt": "if(NOT Pytorch_VERSION VERSION_LESS \"1.5.0\")\n"
                                    "    set(CMAKE_CXX_STANDARD 14)\nendif()\n",
    "horovod/tensorflow/CMakeLists.txt": 'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/'
                                         'tensorflow/xla_mpi_ops.cc")\nlist(APPEND TF_SOURCES "x.cc")\n',
    "cmake/Modules/FindPytorch.cmake": 'string(REGEX REPLACE "No" "" Pytorch_CUDA "${Pytorch_CUDA}")\n'
                                       'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)\n',
    "horovod/common/group_table.h": "#include <queue>\n#include <unordered_map>\n#include <vector>\n",
    "horovod/common/common.h": "#include <memory>\n#include <string>\n#include <unordered_map>\n",
    "horovod/common/operations.cc": "  {\n    global_gloo_context.Initialize(ParseGlooIface());\n  }\n"
                                    "  if (state.control_operation == LibType::GLOO) {\n"
                                    "    // Initializes global controller\n"
                                    "    state.process_set_table.Initialize(global_gloo_context);\n  }\n"
                                    "#if HAVE_GLOO\n  if (state.control_operation == LibType::GLOO) {\n"
                                    "    horovod_global.process_set_table.Finalize(global_gloo_context,\n"
                                    "                                              SHUT_DOWN_ERROR);\n  }\n"
                                    "#endif // HAVE_GLOO\n",
    "horovod/common/util.py": "EXTENSIONS = ['tensorflow', 'torch', 'mxnet']\n"
                              "        try:\n"
                              "            ext = importlib.import_module('.' + ext_base_name, 'horovod')\n"
                              "            result = fn(ext)\n",
    "horovod/runner/mpi_run.py": "_OMPI_FLAGS = ['-mca pml ob1', '-mca btl ^openib']\n"
                                 "    mpi_impl_flags, impl_binding_args, mpi = _get_mpi_implementation_flags(x)\n"
                                 "    if mpi_impl_flags is None:\n        raise Exception(_MPI_NOT_FOUND_ERROR_MSG)\n"
                                 "\n    impi_or_mpich = mpi in (_IMPI_IMPL, _MPICH_IMPL)\n",
    "third_party/gloo/gloo/transport/tcp/pair.cc": "  if (state_ == CONNECTED) {\n    handleReadWrite(events);\n"
                                                   "    return;\n  }\n"
                                                   "void Pair::signalException(std::exception_ptr ex) {\n"
                                                   "  GLOO_ENFORCE(ex_ == nullptr);\n\n",
    "third_party/gloo/gloo/transport/tcp/context.h": "  void signalException(const std::string& msg);\n\n"
                                                     "  friend class ContextMutator;\n",
    "third_party/gloo/gloo/transport/tcp/unbound_buffer.cc":
        "UnboundBuffer::~UnboundBuffer() {}\n\n"
        "  if (recvCompletions_ == 0) {\n    auto done = recvCv_.wait_for(lock, timeout, [&] {\n"
        "  if (sendCompletions_ == 0) {\n    auto done = sendCv_.wait_for(lock, timeout, [&] {\n",
}


def facts(**kw):
    base = dict(python="3.11.7", python_exe="/env/bin/python",
                frameworks={"torch": Framework("torch", "2.13.0+cpu"),
                            "tensorflow": Framework("tensorflow", "2.21.0")},
                mpi="Open MPI 4.1.4", mpi_compiler=True, cxx="/usr/bin/c++", cmake="3.25.1")
    base.update(kw)
    return Facts(**base)


def test_cxx_standard_follows_torch_version():
    plan = decide(facts())
    torch_patch = [p for p in plan.patches() if p.path == "horovod/torch/CMakeLists.txt"][0]
    assert torch_patch.replacement == "set(CMAKE_CXX_STANDARD 17)"
    new = decide(facts(frameworks={"torch": Framework("torch", "2.14.1+cu130", "13.0")}), gpu=False)
    torch_patch = [p for p in new.patches() if p.path == "horovod/torch/CMakeLists.txt"][0]
    assert torch_patch.replacement == "set(CMAKE_CXX_STANDARD 20)"
    # no TF: the TF patch is not applied (it would not be needed, and its file is not built)
    assert all("tensorflow" not in p.path for p in new.patches())
    assert new.env()["HOROVOD_WITHOUT_TENSORFLOW"] == "1" and new.env()["HOROVOD_WITH_PYTORCH"] == "1"


def test_patches_rewrite_the_sdist_lines_and_fail_loudly_elsewhere():
    every = patches([Framework("torch", "2.14.1", "13.0"), Framework("tensorflow", "2.21.0")])
    assert len(every) == 15
    patched = dict(SDIST_LINES)
    for p in every:
        out = apply_patch(SDIST_LINES[p.path], p)
        assert out != SDIST_LINES[p.path]
        assert "CMAKE_CXX_STANDARD 14" not in out and "xla_mpi_ops" not in out
        patched[p.path] = apply_patch(patched[p.path], p)  # a file's patches one after another
    # a failed connection of a Gloo context (a killed peer) ends every wait of that context, not
    # only those on that connection: the pair records it, both waits of an unbound buffer check it
    tcp = "third_party/gloo/gloo/transport/tcp/"
    assert "GLOO_ENFORCE(ex_ == nullptr);\n  context_->markLost(ex);\n" in patched[tcp + "pair.cc"]
    assert "handleReadWrite(events);\n    } catch" in patched[tcp + "pair.cc"]  # both pair.cc patches
    waits = patched[tcp + "unbound_buffer.cc"]
    assert "wait_for" not in waits and waits.count("waitOrLost(") == 3  # the helper and its two calls
    assert waits.index("context->lost()") < waits.index("lock.unlock();") < waits.index("context->closeAll();") \
        < waits.index("std::rethrow_exception(lost);")
    ctx = patched[tcp + "context.h"]
    assert " public:\n" in ctx and "void markLost(" in ctx
    assert ctx.endswith(" protected:\n\n  friend class ContextMutator;\n")
    # the shutdown's negotiation with the other ranks (Gloo) may throw once a rank died: caught
    ops = [p for p in every if p.path.endswith("operations.cc")][0]
    shut = apply_patch(SDIST_LINES[ops.path], ops)
    assert shut.index("try {") < shut.index("Finalize(global_gloo_context") < shut.index("catch (const std::exception")
    assert "FinalizeTensorQueue(failed)" in shut and shut.endswith("  }\n#endif // HAVE_GLOO\n")
    # a CPU build of a CUDA torch: Horovod's probe result is overridden right after it is made
    cpu = [p for p in every if p.path.endswith("FindPytorch.cmake")][0]
    assert apply_patch(SDIST_LINES[cpu.path], cpu).endswith(
        'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)\nset(Pytorch_CUDA FALSE)\n')
    # a failed Gloo rendezvous at start-up: hvd.init() fails in Python instead of an abort
    init = [p for p in every if p.path.endswith("operations.cc") and "initialized (Gloo)" in p.replacement][0]
    started = apply_patch(SDIST_LINES[init.path], init)
    assert started.count("try {") == 2 and started.count("state.initialization_failed = true;\n      return;") == 2
    # an unexpected message in Gloo's transport thread fails the connection instead of aborting
    pair = [p for p in every if p.path.endswith("pair.cc")][0]
    read = apply_patch(SDIST_LINES[pair.path], pair)
    assert read.index("try {") < read.index("handleReadWrite(events)") < read.index("catch (const ::gloo::EnforceNot")
    assert "signalException(" in read and "    }\n    return;\n  }\nvoid Pair::signalException(" in read
    # horovodrun's build probe (gloo_built, mpi_built): the torch extension first (faster to import)
    util = patched["horovod/common/util.py"]
    assert util.startswith("EXTENSIONS = ['torch', 'tensorflow', 'mxnet']\n")
    # ... and reads the build flags (not whether the extension imports) from its library alone,
    # importing the extension as before where the library does not load
    assert util.index("if fn_desc != 'built':") < util.index("ext = HorovodBasics(pkg, lib)") \
        < util.index("except Exception:\n                    ext = None\n") < util.index("if ext is None:\n") \
        < util.index("                ext = importlib.import_module(") < util.index("            result = fn(ext)")
    body = util.split("\n", 1)[1]  # the check's try block, at its indentation in Horovod's function
    compile("def check(fn_desc, ext_base_name, fn):\n    if True:\n" + body + "        except Exception:\n"
            "            pass\n", "util.py", "exec")
    # horovodrun --mpi: Open MPI's ofi BTL (1 s of sleep when it closes) left out, and an MCA
    # parameter of the user's own (--mpi-args) replaces Horovod's default for it
    run = patched["horovod/runner/mpi_run.py"]
    assert run.startswith("_OMPI_FLAGS = ['-mca pml ob1', '-mca btl ^openib,ofi']\n")
    body = run.split("\n", 1)[1]
    ns = {"_get_mpi_implementation_flags": lambda x: (["-mca pml ob1", "-mca btl ^openib,ofi", "-tcp"], [], "OpenMPI"),
          "_MPI_NOT_FOUND_ERROR_MSG": "", "_IMPI_IMPL": "IntelMPI", "_MPICH_IMPL": "MPICH"}
    exec(compile("def flags(settings, x=None):\n" + body + "    return mpi_impl_flags\n", "mpi_run.py", "exec"), ns)
    given = {None: ["-mca pml ob1", "-mca btl ^openib,ofi", "-tcp"],
             "-mca btl ^openib": ["-mca pml ob1", "-tcp"],
             "-x A --mca pml ucx -mca btl_tcp_if_include lo": ["-mca btl ^openib,ofi", "-tcp"]}
    for extra, want in given.items():
        assert ns["flags"](type("S", (), {"extra_mpi_args": extra})) == want, extra
    gpu = patches([Framework("torch", "2.14.1", "13.0")], gpu=True)
    assert not any(p.path.endswith("FindPytorch.cmake") for p in gpu)
    with pytest.raises(InstallError, match="not found in CMakeLists.txt"):
        apply_patch("set(CMAKE_CXX_STANDARD 11)\n", patches([])[0])


def test_refusals_name_the_fix():
    with pytest.raises(InstallError, match="apt-get install -y g\\+\\+"):
        decide(facts(cxx=None))
    with pytest.raises(InstallError, match="pip install cmake"):
        decide(facts(cmake=None))
    with pytest.raises(InstallError, match="pip install cmake"):
        decide(facts(cmake="3.10.2"))
    with pytest.raises(InstallError, match="pip install torch"):
        decide(facts(frameworks={}))
    with pytest.raises(InstallError, match="outside the range.*--force"):
        decide(facts(frameworks={"torch": Framework("torch", "2.15.0")}))
    assert decide(facts(frameworks={"torch": Framework("torch", "2.15.0")}), force=True).frameworks
    with pytest.raises(InstallError, match="does not import"):
        decide(facts(framework_errors={"tensorflow": "ImportError: libcudart.so.12"}))
    with pytest.raises(InstallError, match="unknown framework 'jax'"):
        decide(facts(), frameworks=["jax"])


def test_cuda_framework_needs_a_matching_toolkit_or_cpu():
    cuda_torch = {"torch": Framework("torch", "2.14.1+cu130", "13.0")}
    with pytest.raises(InstallError, match="no CUDA 13 toolkit.*--cpu"):
        decide(facts(frameworks=cuda_torch))
    with pytest.raises(InstallError, match="no CUDA 13 toolkit"):
        decide(facts(frameworks=cuda_torch, toolkits=[Toolkit("/usr/local/cuda-12.9", "12.9")]))
    plan = decide(facts(frameworks=cuda_torch, toolkits=[Toolkit("/usr/local/cuda-12.9", "12.9"),
                                                         Toolkit("/usr/local/cuda-13.0", "13.0")]))
    assert plan.gpu and plan.toolkit.version == "13.0" and plan.env()["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    cpu = decide(facts(frameworks=cuda_torch), gpu=False)
    assert not cpu.gpu and "HOROVOD_GPU_OPERATIONS" not in cpu.env()
    with pytest.raises(InstallError, match="CPU build"):
        decide(facts(), gpu=True)
    mixed = {"torch": Framework("torch", "2.13.0", "13.0"), "tensorflow": Framework("tensorflow", "2.21.0", "12.5")}
    with pytest.raises(InstallError, match="different CUDA major.*--frameworks"):
        decide(facts(frameworks=mixed, toolkits=[Toolkit("/c", "13.0")]))


def test_mpi_is_used_only_with_its_headers():
    assert decide(facts()).env()["HOROVOD_WITH_MPI"] == "1"
    no_headers = decide(facts(mpi_compiler=False))
    assert no_headers.mpi is None and no_headers.env()["HOROVOD_WITHOUT_MPI"] == "1"
    assert any("libopenmpi-dev" in r for r in no_headers.reasons)
    assert decide(facts(mpi=None, mpi_compiler=False)).env()["HOROVOD_WITH_GLOO"] == "1"


def test_cache_key_names_versions_and_a_superset_wheel_serves(tmp_path):
    both = decide(facts())
    key = both.key()
    for part in ("horovod0.28.1", "torch2.13.0+cpu", "tensorflow2.21.0", "py3.11.7", "openmpi4.1.4", "cpu"):
        assert part in key
    wheel = tmp_path / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"")
    stored = build.store(str(tmp_path / "cache"), both, str(wheel))
    assert build.cached_wheel(str(tmp_path / "cache"), both) == stored
    with open(os.path.join(os.path.dirname(stored), "build.json")) as f:
        assert json.load(f)["frameworks"] == {"torch": "2.13.0+cpu", "tensorflow": "2.21.0"}
    # an environment with the same torch and no TF is served by the torch+TF wheel ...
    torch_only = decide(facts(frameworks={"torch": Framework("torch", "2.13.0+cpu")}))
    assert torch_only.key() != key
    assert build.cached_wheel(str(tmp_path / "cache"), torch_only) == stored
    # ... but not one with another torch, Python or MPI
    for other in (facts(frameworks={"torch": Framework("torch", "2.13.1")}), facts(python="3.12.1"),
                  facts(mpi="MPICH 4.1")):
        assert build.cached_wheel(str(tmp_path / "cache"), decide(other)) is None



def test_newer_compilers_and_cmake_get_what_they_need_and_older_ones_nothing_more():
    """GCC 13 (seen on a GPU machine: 13.3) needs two missing standard includes; CMake 4 refuses
    Gloo's old minimum version unless CMAKE_POLICY_VERSION_MINIMUM is set. GCC 12 / CMake 3 get
    neither, so their cached wheels keep their keys."""
    old = decide(facts(cxx_version="GNU 12.2.0"))
    assert old.key() == decide(facts()).key()
    assert "CMAKE_POLICY_VERSION_MINIMUM" not in old.env()
    new = decide(facts(cxx_version="GNU 13.3.0", cmake="4.4.3"))
    assert new.key() != old.key() and new.env()["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5"
    added = {p.path: p for p in new.patches()} .keys() - {p.path for p in old.patches()}
    assert added == {"horovod/common/group_table.h", "horovod/common/common.h"}
    for p in new.patches():
        if p.path in added:
            text = apply_patch(SDIST_LINES[p.path], p)
            assert text.index("#include <string>") < text.index("#include <unordered_map>")
    assert "#include <stdexcept>" in apply_patch(SDIST_LINES["horovod/common/common.h"],
                                                 [p for p in new.patches() if p.path.endswith("common.h")][0])
    assert len(decide(facts(cxx_version="Clang 17.0.6")).patches()) == len(old.patches())


def test_build_requirements_upgrade_a_setuptools_too_old_for_python_312():
    """Horovod's setup.py runs without isolation in the target environment. setuptools < 66.1
    fails there on Python >= 3.12 (pkgutil.ImpImporter; seen with 65.5.0 and Horovod 0.28.1's
    egg_info), so it is upgraded; on 3.11 it is left alone, and a current one anywhere."""
    from hvdp.install.recipe import SETUPTOOLS, build_requirements
    have = {"setuptools": "65.5.0", "wheel": "0.45.1", "packaging": "24.2", "cffi": None}
    assert build_requirements("3.11.7", have) == ()
    for py in ("3.12.1", "3.13.0"):
        (spec, why), = build_requirements(py, have)
        assert spec == SETUPTOOLS and "65.5.0" in why and "ImpImporter" in why
    assert build_requirements("3.13.0", dict(have, setuptools="84.2.1")) == ()
    assert build_requirements("3.12.1", dict(have, setuptools="66.1.0")) == ()
    # absent ones are installed; cffi only for torch
    got = build_requirements("3.12.1", {"setuptools": None, "wheel": None, "packaging": "24.2"},
                             [Framework("torch", "2.14.1")])
    assert [s for s, _ in got] == [SETUPTOOLS, "wheel", "cffi>=1.4.0"]
    assert build_requirements("3.12.1", dict(have, setuptools="84.2.1", packaging=None),
                              [Framework("tensorflow", "2.21.0")]) == (("packaging", "packaging is not installed"),)
