"""The source changes hvdp's recipe makes to Horovod's sdist (each a regex that must match, so
another sdist fails loudly instead of building something else), and why each is needed. The
recipe (``hvdp.install.recipe``) applies them; docs/install-horovod.md has the same table for
readers."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

from .facts import Framework


@dataclass(frozen=True)
class Patch:
    path: str
    pattern: str
    replacement: str
    why: str


def cxx_standard(fw: Framework) -> int:
    """The C++ standard a framework's headers need: torch >= 2.14 uses C++20 features
    (``std::strong_ordering``); older torch and TensorFlow compile as C++17."""
    if fw.name == "torch" and fw.release[:2] >= (2, 14):
        return 20
    return 17


def _gnu_major(cxx_version: Optional[str]) -> int:
    m = re.match(r"GNU (\d+)\.", cxx_version or "")
    return int(m.group(1)) if m else 0


GLOO_INIT_FAILED = (r"    } catch (const std::exception& ex) {\n"
                    r'      LOG(ERROR) << "Horovod could not be initialized (Gloo): " << ex.what();\n'
                    r"      state.initialization_failed = true;\n      return;\n    }\n")


def _lost_peer_patches() -> Tuple[Patch, ...]:
    """A Gloo context whose connection to one peer failed ends every wait of that context.

    Every collective of a Gloo context involves all its ranks, so once one connection of it is
    closed or reset (a killed peer), no operation of it can complete. Gloo failed only the
    operations pending on that one connection; a survivor waiting on another live rank (which
    might itself be waiting on the first) waited out HOROVOD_GLOO_TIMEOUT_SECONDS (30 s by default)."""
    tcp = "third_party/gloo/gloo/transport/tcp/"
    why = ("after a rank was killed, a survivor whose pending operation waited on another survivor "
           "(not on the dead rank) noticed nothing until Gloo's timeout: in the kill loop 3 of 5 kills "
           "took HOROVOD_GLOO_TIMEOUT_SECONDS to recover (30 s at Horovod's default). The context "
           "keeps its first failed connection; every wait of that context ends with that error "
           "within 50 ms")
    return (
        Patch(tcp + "context.h", r"^(  void signalException\(const std::string& msg\);\n)",
              r"\1\n public:\n  // hvdp: the first connection of this context that failed; waits end with it\n"
              r"  std::mutex lostMutex_;\n  std::exception_ptr lost_;\n"
              r"  void markLost(std::exception_ptr ex) {\n"
              r"    std::lock_guard<std::mutex> guard(lostMutex_);\n    if (!lost_) {\n      lost_ = ex;\n    }\n  }\n"
              r"  std::exception_ptr lost() {\n"
              r"    std::lock_guard<std::mutex> guard(lostMutex_);\n    return lost_;\n  }\n"
              r'  void closeAll() {\n    signalException("a connection of this context failed");\n  }\n\n'
              r" protected:\n", why),
        Patch(tcp + "pair.cc", r"^(void Pair::signalException\(std::exception_ptr ex\) \{\n"
              r"  GLOO_ENFORCE\(ex_ == nullptr\);\n)", r"\1  context_->markLost(ex);\n", why),
        Patch(tcp + "unbound_buffer.cc", r"^(UnboundBuffer::~UnboundBuffer\(\) \{\}\n)",
              r"\1\n// hvdp: a wait in slices of 50 ms that also ends, closing the context, when a connection\n"
              r"// of the context failed (every collective needs every rank of its context)\n"
              r"template <typename Pred>\n"
              r"static bool waitOrLost(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,\n"
              r"                       std::chrono::milliseconds timeout, Context* context, Pred pred) {\n"
              r"  const auto deadline = std::chrono::steady_clock::now() + timeout;\n"
              r"  for (;;) {\n"
              r"    auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(50);\n"
              r"    if (until > deadline) {\n      until = deadline;\n    }\n"
              r"    if (cv.wait_until(lock, until, pred)) {\n      return true;\n    }\n"
              r"    if (until >= deadline) {\n      return false;\n    }\n"
              r"    auto lost = context->lost();\n"
              r"    if (lost) {\n"
              r"      // as after a timeout: close every connection of the context (without this lock)\n"
              r"      lock.unlock();\n"
              r"      context->closeAll();\n"
              r"      std::rethrow_exception(lost);\n    }\n"
              r"  }\n}\n", why),
        Patch(tcp + "unbound_buffer.cc",
              r"auto done = (recv|send)Cv_\.wait_for\(lock, timeout, \[&\] \{\n",
              r"auto done = waitOrLost(\1Cv_, lock, timeout, context_.get(), [&] {\n", why),
    )


def _mpirun_patches() -> Tuple[Patch, ...]:
    """``horovodrun --mpi``'s Open MPI flags.

    Horovod passes ``-mca pml ob1 -mca btl ^openib``. Open MPI 4.1's ``ofi`` BTL (built wherever
    Open MPI is built with libfabric, as Debian's and Ubuntu's are) then loads, and its close
    sleeps one second in ``MPI_Finalize``: every job's exit took 1 s more (only one-sided MPI
    uses that BTL by default; Horovod's ob1 point-to-point and collectives do not). And since
    Open MPI refuses an MCA parameter listed twice, ``--mpi-args="-mca btl ..."`` could not
    replace Horovod's choice: the launch failed."""
    run = "horovod/runner/mpi_run.py"
    return (
        Patch(run, r"^_OMPI_FLAGS = \['-mca pml ob1', '-mca btl \^openib'\]$",
              "_OMPI_FLAGS = ['-mca pml ob1', '-mca btl ^openib,ofi']",
              "every horovodrun --mpi job spent 1 s more in MPI_Finalize: Open MPI 4.1's ofi BTL, "
              "loaded under Horovod's flags where Open MPI has libfabric (Debian's), sleeps 1 s when it "
              "closes (a 2-rank job's shutdown here: 1.0 s -> 0.05 s); that BTL serves one-sided MPI only "
              "by default, which Horovod does not use"),
        Patch(run, r"^(    if mpi_impl_flags is None:\n        raise Exception\(_MPI_NOT_FOUND_ERROR_MSG\)\n)",
              r"\1    # hvdp: an MCA parameter the user gives in --mpi-args replaces Horovod's default for it\n"
              r"    import re as _re\n"
              r"    _own = set(_re.findall(r'(?:^|\\s)--?mca\\s+(\\S+)', settings.extra_mpi_args or ''))\n"
              r"    _param = [_re.match(r'--?mca\\s+(\\S+)', f) for f in mpi_impl_flags]\n"
              r"    mpi_impl_flags = [f for f, m in zip(mpi_impl_flags, _param) if not (m and m.group(1) in _own)]\n",
              "horovodrun --mpi --mpi-args='-mca btl ...' failed (Open MPI refuses an MCA parameter listed "
              "twice, and Horovod always passes -mca pml and -mca btl): the user's value now replaces "
              "Horovod's default for that parameter"),
    )


def patches(frameworks: Iterable[Framework], gpu: bool = False,
            cxx_version: Optional[str] = None) -> Tuple[Patch, ...]:
    """The source changes for these frameworks and compiler (each pattern must match the sdist)."""
    out = []
    if _gnu_major(cxx_version) >= 13:
        # GCC 13's standard headers include fewer others; Horovod 0.28.1 relied on that (seen
        # with GCC 13.3: std::string in group_table.h, std::logic_error in common.h)
        out += [Patch("horovod/common/group_table.h", r"^(#include <unordered_map>\n)",
                      r"#include <string>\n\1", f"{cxx_version} needs <string> included where it is used"),
                Patch("horovod/common/common.h", r"^(#include <string>\n)",
                      r"#include <cstdint>\n#include <stdexcept>\n\1",
                      f"{cxx_version} needs <stdexcept> and <cstdint> included where they are used")]
    out += [Patch("CMakeLists.txt", r"^set\(CMAKE_CXX_STANDARD 14\)", "set(CMAKE_CXX_STANDARD 17)",
                 "Horovod's common sources with C++17, the standard its TF extension already uses")]
    out.append(Patch("horovod/common/operations.cc",
                     r"^(  if \(state\.control_operation == LibType::GLOO\) \{\n)"
                     r"(    horovod_global\.process_set_table\.Finalize\(global_gloo_context,\n"
                     r"\s+SHUT_DOWN_ERROR\);\n)(  \}\n)",
                     r"\1    try {\n  \2    } catch (const std::exception& ex) {\n"
                     r"      LOG(ERROR, horovod_global.global_controller->GetRank())\n"
                     r'          << "Horovod could not finalize its process sets with the others: " << ex.what();\n'
                     r"      const Status failed = Status::UnknownError(\n"
                     r'          SHUT_DOWN_ERROR.reason() + " (" + ex.what() + ")");\n'
                     r"      for (auto id : horovod_global.process_set_table.Ids()) {\n"
                     r"        horovod_global.process_set_table.Get(id).tensor_queue.FinalizeTensorQueue(failed);\n"
                     r"      }\n    }\n\3",
                     "after a rank died, the shutdown of a job with more than one process set (two-level "
                     "reduction) negotiates over Gloo with the dead rank; the gloo::IoException it throws "
                     "there escaped every handler and aborted each survivor in C++ (std::terminate) before "
                     "Python saw an error. Caught: the pending operations end with Horovod's shut-down "
                     "error, which hvdp reports"))
    out.append(Patch("horovod/common/operations.cc",
                     r"^(  \{\n)    global_gloo_context\.Initialize\(ParseGlooIface\(\)\);\n(  \}\n)"
                     r"(  if \(state\.control_operation == LibType::GLOO\) \{\n    // Initializes global controller\n)"
                     r"    state\.process_set_table\.Initialize\(global_gloo_context\);\n(  \}\n)",
                     r"\1    try {\n      global_gloo_context.Initialize(ParseGlooIface());\n"
                     + GLOO_INIT_FAILED + r"\2"
                     r"\3    try {\n      state.process_set_table.Initialize(global_gloo_context);\n"
                     + GLOO_INIT_FAILED + r"\4",
                     "a worker whose Gloo rendezvous fails (an elastic job's restarted worker timing out on "
                     "its peers) threw from the background thread's start, outside every handler, and the "
                     "process aborted in C++; caught: hvd.init() then raises Horovod's 'initialization "
                     "failed' error, after the log line 'Horovod could not be initialized (Gloo): <cause>'"))
    out.append(Patch("third_party/gloo/gloo/transport/tcp/pair.cc",
                     r"^(  if \(state_ == CONNECTED\) \{\n)    handleReadWrite\(events\);\n(    return;\n  \}\n)",
                     r"\1    try {\n      handleReadWrite(events);\n"
                     r"    } catch (const ::gloo::EnforceNotMet& ex) {\n"
                     r"      if (ex_ == nullptr) {\n"
                     r'        signalException(GLOO_ERROR_MSG("unexpected data from ", peer_.str(), ": ", '
                     r'ex.what()));\n'
                     r"      }\n    }\n\2",
                     "under repeated kills a survivor's Gloo transport thread met a message it did not expect "
                     "(an enforce in the read path, e.g. 'op.preamble.length <= op.nbytes. 8 vs 4') and "
                     "threw outside every handler: the process aborted in C++. Caught: the connection fails "
                     "as on a reset by the peer, its pending operations end with that error, and Horovod's "
                     "shutdown error reaches Python (an elastic job then recovers)"))
    out += _lost_peer_patches()
    out.append(Patch("horovod/common/util.py", r"^EXTENSIONS = \['tensorflow', 'torch', 'mxnet'\]$",
                     "EXTENSIONS = ['torch', 'tensorflow', 'mxnet']",
                     "horovodrun asks whether Horovod was built with Gloo (or MPI) on every launch by "
                     "importing the first framework extension that loads, in a fresh process: TensorFlow "
                     "first took 4.6 s here, torch takes 1.5 s; every extension of one build shares those "
                     "flags, so torch is asked first (TensorFlow where torch is not built)"))
    out.append(Patch("horovod/common/util.py",
                     r"^(        try:\n)"
                     r"(            ext = importlib\.import_module\('\.' \+ ext_base_name, 'horovod'\)\n)",
                     r"\1            ext = None\n"
                     r"            if fn_desc != 'built':  # hvdp: a build flag from the library alone\n"
                     r"                try:\n"
                     r"                    import importlib.util\n"
                     r"                    from horovod.common.basics import HorovodBasics\n"
                     r"                    pkg = importlib.util.find_spec('horovod.' + ext_base_name).origin\n"
                     r"                    lib = 'mpi_lib_v2' if ext_base_name == 'torch' else 'mpi_lib'\n"
                     r"                    ext = HorovodBasics(pkg, lib)\n"
                     r"                except Exception:\n"
                     r"                    ext = None\n"
                     r"            if ext is None:\n    \2",
                     "horovodrun asks whether Horovod was built with Gloo (or MPI) on every launch in a fresh "
                     "process that imported the whole framework extension (there, 0.9 s of torch import); "
                     "the build flags are functions of the extension's library, which loads alone in 0.16 s. "
                     "The library is asked first; where it does not load, the extension is imported as "
                     "before; whether an extension is available at all (--check-build) still imports it"))
    out += _mpirun_patches()
    for fw in frameworks:
        if fw.name == "torch":
            std = cxx_standard(fw)
            out.append(Patch("horovod/torch/CMakeLists.txt", r"set\(CMAKE_CXX_STANDARD 14\)",
                             f"set(CMAKE_CXX_STANDARD {std})",
                             f"torch {fw.version}'s headers need C++{std} (Horovod pins C++14)"))
            if fw.cuda and not gpu:
                out.append(Patch("cmake/Modules/FindPytorch.cmake",
                                 r'^(string\(TOUPPER "\$\{Pytorch_CUDA\}" Pytorch_CUDA\)\n)',
                                 r"\1set(Pytorch_CUDA FALSE)\n",
                                 "a CPU build for a CUDA torch: Horovod would compile its torch extension "
                                 "with CUDA whenever torch finds any toolkit; with --cpu it is plain C++"))
        elif fw.name == "tensorflow":
            out.append(Patch("horovod/tensorflow/CMakeLists.txt",
                             r'^list\(APPEND TF_SOURCES "\$\{PROJECT_SOURCE_DIR\}/horovod/tensorflow/'
                             r'xla_mpi_ops\.cc"\)\n', "",
                             "xla_mpi_ops.cc (XLA custom calls, GPU jit_compile only) includes headers "
                             "TF >= 2.16 no longer ships; every regular TF op is still built"))
    return tuple(out)
