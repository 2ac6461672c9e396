# DLCP developer entry points. Every target that runs Python first makes sure the venv exists.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dlcp-installed
CI_STAMP := $(VENV)/.dlcp-ci-installed
# PyTorch, installed first so the extras keep it. Where pip's index is plain PyPI (which serves
# the CUDA build on Linux), get the CPU build with TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=

# The compiled data path: `make setup` builds it again when its sources change.
NATIVE     := $(wildcard hostagent/native/*.cc) $(wildcard hostagent/native/*.h) $(wildcard hostagent/native/*.inc) hostagent/native/CMakeLists.txt

P4C        ?= p4c-bm2-ss
P4_SOURCES := $(wildcard p4/*.p4) $(wildcard p4/include/*.p4) $(wildcard p4/include/control/*.p4)

.PHONY: setup setup-ci mininet-link check test test-unit sanitize demo demo-testbed demo-drop bench p4 clean help

help:
	@echo "make setup   create $(VENV) and install DLCP with all Python dependencies"
	@echo "make test    run the test suite (BMv2/p4c/root tests skip with a reason when missing)"
	@echo "make check   lint (ruff) and type-check (mypy) the packages, scripts and tests"
	@echo "make sanitize  the data-path tests on the C++ path built with TSan, then ASan + UBSan"
	@echo "make setup-ci  setup plus the sim (ns-3) and mnist1d extras, so no test skips but BMv2/p4c/root"
	@echo "make demo    train digits with 4 workers + PS on loopback: lossless vs bounded loss"
	@echo "make demo-drop  one real gradient through a modelled congested port (no training)"
	@echo "make bench   print the benchmarks' figures and keep them in runs/bench-<time>/ (BENCH_OUT=...)"
	@echo "make p4      recompile p4/ into p4/build/ (needs p4c-bm2-ss)"

setup: $(STAMP) mininet-link

# pip builds hostagent/native (C++17, nanobind) with the system's g++ and CMake through
# scikit-build-core; both come from the package index into pip's build environment if missing.
$(STAMP): pyproject.toml $(NATIVE)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "DLCP needs Python >= 3.10; set PYTHON=python3.X")'
	@command -v g++ >/dev/null || { echo "g++ not found: the data path is C++ (apt-get install g++)"; exit 1; }
	@printf '#include <openssl/evp.h>\n' | g++ -E -x c++ - >/dev/null 2>&1 || { echo "OpenSSL 3 headers not found: the data path seals every packet with them (apt-get install libssl-dev)"; exit 1; }
	@printf '#include <intel-ipsec-mb.h>\n' | g++ -E -x c++ - >/dev/null 2>&1 || echo "note: intel-ipsec-mb not found; packet tags will use OpenSSL, 3-4x slower (apt-get install libipsec-mb-dev, then make clean setup)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VENV)/bin/pip install --quiet -e '.[all]'
	$(PY) -c 'import dlcp.hostagent._datapath'
	@# the c10d Backend of init_process_group("dlcp"), compiled against this torch (about a minute, once)
	$(PY) -c 'from dlcp_torch import c10d_backend as c; c.load() or print("note: dlcp c10d backend not built:", c.why_not())'
	@touch $@

# What CI runs on: setup plus the extras whose tests skip without them (ns-3 for the simulator,
# about 520 MB; MNIST-1D), so every test but the BMv2/p4c/root ones runs.
setup-ci: $(CI_STAMP) mininet-link

$(CI_STAMP): $(STAMP)
	$(VENV)/bin/pip install --quiet -e '.[all,sim,mnist1d]'
	@touch $@

# Mininet is not on PyPI: link Debian's package (apt-get install mininet) into the venv if
# present, on every run, so installing it after the venv was made needs no other step.
mininet-link: $(STAMP)
	@if [ -d /usr/lib/python3/dist-packages/mininet ]; then \
		ln -sfn /usr/lib/python3/dist-packages/mininet "$$(ls -d $(VENV)/lib/python3*/site-packages)/mininet"; fi

test: setup
	$(PY) -m pytest

# ruff and mypy read their settings (rules, files, third-party modules without types) from pyproject.toml
check: setup
	$(VENV)/bin/ruff check hostagent controller dlcp_torch topologies dlcp_sim dlcp examples bench tests
	$(VENV)/bin/mypy

test-unit: setup
	$(PY) -m pytest tests/unit

# The compiled data path built with ThreadSanitizer, then with AddressSanitizer and
# UndefinedBehaviorSanitizer (any report fails), each running the tests that drive its threads,
# sockets and bindings; the tests load that build in place of the installed one
# (DLCP_NATIVE_MODULE, tests/conftest.py). Python itself is not instrumented, so the runtime is
# preloaded, with libstdc++ (ASan intercepts C++ throws only if it is there from the start);
# ASan's leak check is off (the interpreter does not free everything at exit).
SANITIZE_TESTS ?= tests/transport/test_datapath.py tests/transport/test_sealing.py tests/transport/test_hostile.py \
                  tests/transport/test_core_rules.py tests/transport/test_aegis_mac.py
sanitize: setup
	@set -e; for s in thread address,undefined; do \
	  d=build/sanitize-$$(echo $$s | tr , -); rm -rf $$d/wheel; \
	  $(VENV)/bin/pip wheel --quiet --no-deps -w $$d/wheel -C build-dir=$$d/build -C cmake.build-type=Debug \
	    -C cmake.define.DLCP_SANITIZE=$$s . ; \
	  so=$$($(PY) -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); n = next(n for n in z.namelist() if "/_datapath." in n); print(z.extract(n, sys.argv[2]))' $$d/wheel/*.whl $$d); \
	  rt="$$(g++ -print-file-name=lib$$(echo $$s | cut -d, -f1 | sed 's/thread/tsan/;s/address/asan/').so) $$(g++ -print-file-name=libstdc++.so)"; \
	  echo "== $$s: $$so"; \
	  DLCP_NATIVE_MODULE=$$so LD_PRELOAD=$$rt TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
	    ASAN_OPTIONS="detect_leaks=0 halt_on_error=1" UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1" \
	    $(PY) -m pytest -q -p no:cacheprovider $(SANITIZE_TESTS); \
	done

demo: setup
	$(PY) examples/train_digits.py --workers 4 --compare --out runs/demo-$(shell date +%Y%m%d-%H%M%S).json

# The same training through the Mininet testbed of BMv2 switches (needs root, BMv2, Mininet).
demo-testbed: setup
	$(VENV)/bin/dlcp run --topology star --workers 4 --workload digits --iterations 100 --scheme baseline,dlcp

demo-drop: setup
	$(VENV)/bin/dlcp demo

# Each benchmark also keeps its tables in $(BENCH_OUT) (dlcp report FILE prints them as Markdown).
ifndef BENCH_OUT
BENCH_OUT := runs/bench-$(shell date +%Y%m%d-%H%M%S)
endif
bench: setup
	$(PY) bench/packetizer.py --out $(BENCH_OUT)/packetizer.json
	$(PY) bench/transport.py --out $(BENCH_OUT)/transport.json
	$(PY) bench/hostile.py --out $(BENCH_OUT)/hostile.json

p4:
	@command -v $(P4C) >/dev/null || { echo "$(P4C) not found: install p4c (p4lang's packages) first"; exit 1; }
	@test -f p4/dlcp.p4 || { echo "p4/dlcp.p4 does not exist yet"; exit 1; }
	$(P4C) --arch v1model --std p4-16 -I p4/include --p4runtime-files p4/build/dlcp.p4info.txt \
		-o p4/build/dlcp.json p4/dlcp.p4

clean:
	rm -rf $(VENV) .pytest_cache *.egg-info build
