# Temporary: run the checksum tests/bench on the GPU box, which lacks pyzmq (distnb/__init__ imports it).
import runpy, sys, types
class _Any(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return 0
sys.modules["zmq"] = _Any("zmq")
sys.modules["zmq"].__file__ = "/nonexistent/zmq.py"
what = sys.argv[1]
sys.argv = sys.argv[1:]
if what == "pytest":
    import pytest
    sys.exit(pytest.main(sys.argv[1:]))
runpy.run_path(what, run_name="__main__")
