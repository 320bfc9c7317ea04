# Wraps CMake for those who just want it to work:
#   make                 install missing Debian packages, build, run the main job
#   make test            ... build, run the test suites
#   make sanitize-test   ... build with ASan+UBSan in build-san/, run the fast tests
#   make clean
# Options go to CMake through CMAKE_ARGS, e.g. make test CMAKE_ARGS=-DMOE_CUDA=OFF

BUILD      ?= build
SAN_BUILD  ?= build-san
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=
# The trainer is the main job once it exists; the layer benchmark until then.
MAIN_JOB   ?= $(if $(wildcard engine/cli/moe_train.c),$(BUILD)/moe-train --overwrite,$(BUILD)/moe-bench layer)

DEBIAN_PACKAGES := build-essential cmake pkg-config libopenblas-dev libopenblas-openmp-dev \
                   libcriterion-dev libopenmpi-dev openmpi-bin libhwloc-dev hwloc

.PHONY: run deps build test sanitize-test clean

run: build
	$(MAIN_JOB)

deps:
	@command -v dpkg-query >/dev/null || { echo "not Debian: skipping the package check"; exit 0; }; \
	missing=$$(for p in $(DEBIAN_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	[ -z "$$missing" ] && exit 0; \
	if [ "$$(id -u)" = 0 ]; then \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $$missing; \
	else \
	  echo "missing Debian packages; install them with:"; \
	  echo "  sudo apt-get install -y" $$missing; exit 1; \
	fi

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

# Two suites at a time, two OpenMP threads each, on two cores: threads
# outnumber the cores, and libgomp's spinning waits take the cores the
# other suite's threads need (README, Threads). Passive waits made a set of
# suites 5.9x faster in one run than spinning ones did on a busy machine.
TEST_ENV = OMP_WAIT_POLICY=passive

test: build
	$(TEST_ENV) ctest --test-dir $(BUILD) --output-on-failure -j2

# -O1 keeps ASan's reports readable and its runs fast. The sanitizers cover
# the C code and the C++ tests; CUDA stays off because its runtime needs its
# own ASan settings.
sanitize-test: deps
	cmake -S . -B $(SAN_BUILD) -DMOE_SANITIZE=ON -DMOE_CUDA=OFF \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O1 -g" \
	  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" $(CMAKE_ARGS)
	cmake --build $(SAN_BUILD) -j $(JOBS)
	$(TEST_ENV) ctest --test-dir $(SAN_BUILD) --output-on-failure -j2 -LE slow

clean:
	rm -rf $(BUILD) $(SAN_BUILD)
