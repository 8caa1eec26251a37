"""What `import ringreduce` costs every rank: it must not import ml_dtypes (most of a
second), yet bfloat16 arrays must work as soon as their owner has it."""
import subprocess
import sys

import pytest

from launch import job_env, run_script


def test_import_leaves_ml_dtypes_unimported_but_lists_bfloat16():
    pytest.importorskip("ml_dtypes")
    code = ("import sys, ringreduce as rr; "
            "print('ml_dtypes' in sys.modules, 'bfloat16' in rr.supported_dtypes())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=job_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]


BFLOAT16_AFTER_IMPORT = """
import numpy as np
import ringreduce as rr
from ringreduce import reference
import ml_dtypes  # after ringreduce: it learns the dtype from the first array

ring = rr.Communicator(timeout=60)
x = (np.arange(1000) * (ring.rank + 1) / 7).astype(ml_dtypes.bfloat16)
out = np.empty_like(x)
from ringreduce import _types
assert x.dtype not in _types.dtype_codes
first = ring.allreduce(x)  # (before the reference's, whose checks are the core's own)
expected = reference.allreduce(x, op="sum")
assert first.tobytes() == expected.tobytes()
for _ in range(3):  # the first call teaches the table; the next go by the fast path
    assert ring.allreduce(x, out=out) is out
    assert _types.dtype_codes[x.dtype] == rr._core.DTYPES.index("bfloat16")
    assert out.tobytes() == expected.tobytes()
    assert ring.allreduce(x).tobytes() == expected.tobytes()
gathered = ring.allgather(x)
assert gathered.dtype == x.dtype
assert gathered.tobytes() == reference.allgather(x).tobytes()
done = ring.allreduce(np.ones(1, np.int64))  # every rank got here
if ring.rank == 0:
    print("ok on", int(done[0]), "ranks")
"""


@pytest.mark.parametrize("ranks", [1, 3])
def test_bfloat16_works_when_ml_dtypes_comes_after_ringreduce(tmp_path, ranks):
    pytest.importorskip("ml_dtypes")
    done = run_script(tmp_path, "bf16.py", BFLOAT16_AFTER_IMPORT, ranks=ranks)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", "on", str(ranks), "ranks"]


def test_import_leaves_shutil_unimported():
    # (It brings bz2 and lzma: 1.5 ms of every rank's start, for advice on errors.)
    code = ("import sys, numpy, mpi4py.MPI; before = 'shutil' in sys.modules; "
            "import ringreduce; print(before or 'shutil' not in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=job_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]


def test_errors_are_named_as_users_catch_them_and_pickle():
    import ringreduce as rr
    # (From a review.) Tracebacks said "ringreduce._core.CollectiveTimeoutError", a
    # name no user imports.
    import pickle
    for kind in (rr.MismatchError, rr.MPIError, rr.CollectiveTimeoutError,
                 rr.UnsupportedOpError, rr.DroppedErrorWarning):
        assert f"{kind.__module__}.{kind.__qualname__}" == f"ringreduce.{kind.__name__}"
        again = pickle.loads(pickle.dumps(kind("what went wrong")))
        assert type(again) is kind and str(again) == "what went wrong"


FIRST_CALLS = """
import sys
import numpy as np
import ringreduce as rr
from ringreduce.optim import SGD, DistributedOptimizer

ring = rr.Communicator(timeout=60)
x = np.ones(4 * ring.size)
ring.allreduce(x, out=np.empty_like(x))
ring.reduce_scatter(x, out=np.empty(4))
ring.allgather(x, out=np.empty(x.size * ring.size))
ring.broadcast(x)
ring.allreduce_async(x, out=np.empty_like(x)).wait()
rr.allreduce_gradients([x.copy(), np.ones(3, np.float32)], comm=ring)
params = [np.ones(3)]
DistributedOptimizer(SGD(params, lr=0.1), comm=ring).step([np.ones(3)])
ring.close()
said = [str("numpy.ma" in sys.modules)]
import numpy.ma  # once it is, masked arrays are still refused
again = rr.Communicator(timeout=60)
for call in (lambda: again.allreduce(np.ma.masked_array(x, mask=x > 0)),
             lambda: again.allreduce(x, out=np.ma.masked_array(x, mask=x > 0))):
    try:
        call()
    except TypeError as error:
        said.append("refused" if "masked array with masked elements" in str(error) else str(error))
if again.rank == 0:
    print(" ".join(said))
again.close()
"""


@pytest.mark.parametrize("ranks", [1, 2])
def test_first_calls_leave_numpy_ma_unimported(tmp_path, ranks):
    # numpy imports numpy.ma on first use: 6 ms of a rank's first call with out= (or
    # its optimizer's first step), 30 ms where its bytecode is not cached. No masked
    # array can exist before it is imported, so none is looked for.
    done = run_script(tmp_path, "first_calls.py", FIRST_CALLS, ranks=ranks)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "refused", "refused"]
