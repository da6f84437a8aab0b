# The two newcomer commands (see README): `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PORT ?= 8080
MODEL ?= /tmp/gaudi-serve-tiny-llama

.PHONY: venv kernels serve test lint proto e2e images

$(BIN)/gaudi-serve: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[runtime,operator,test]'
	$(BIN)/pip install -q --no-deps 'text-generation==0.7.0'
	$(MAKE) kernels
	touch $@

venv: $(BIN)/gaudi-serve

# The CPU kernels prebuilt for each instruction-set level into runtime/gaudi_runtime/device/prebuilt,
# so that servers start without compiling; without a compiler, they are compiled (or not) at start.
kernels:
	$(BIN)/gaudi-serve build-kernels || echo "make kernels: not prebuilt; the CPU kernels compile at start if they can"

# Serve a tiny random-weight Llama generated on the spot, on CPU. The limits leave room for a tool
# call (the tool prompt alone is about 300 tokens of this tokenizer) and a short conversation.
serve: venv
	test -f $(MODEL)/config.json || $(BIN)/gaudi-serve tiny-model $(MODEL) --family llama
	$(BIN)/gaudi-serve launch --model-id $(MODEL) --hostname 127.0.0.1 --port $(PORT) \
	  --dtype float32 --max-input-tokens 3072 --max-total-tokens 4096 --max-batch-prefill-tokens 4096 \
	  --max-batch-size 16

test: venv
	$(BIN)/ruff check runtime operator tests
	$(BIN)/python -m pytest -q tests; code=$$?; [ $$code -eq 5 ] && echo "no tests ran" && exit 1; exit $$code

lint: venv
	$(BIN)/ruff check runtime operator tests

proto: venv
	PATH=$(BIN):$$PATH hack/gen-proto.sh

# End-to-end suite (also part of `make test`): a real control plane built from source by
# hack/control-plane.sh and hack/autoscaling-tools.sh (cached per machine), or the cluster of
# E2E_KUBECONFIG (docs/e2e.md).
e2e: venv
	GAUDI_SERVE_E2E_KUBECONFIG=$(E2E_KUBECONFIG) $(BIN)/python -m pytest -q tests/e2e

# Both images (operator; runtime, cpu variant unless VARIANT=hpu) with docker, podman or buildah:
# hack/build-images.sh, whose header lists the settings; without a registry the Python base is
# made by hack/base-image.sh. E.g. make images REGISTRY=registry.example.com/ml TAG=0.1.0
IMAGE_SETTINGS := REGISTRY TAG VARIANT OPERATOR_IMAGE RUNTIME_IMAGE IMAGES PYTHON_IMAGE TORCH_CPU_INDEX \
	HPU_BASE_IMAGE ENGINE ISOLATION BUILD_FLAGS
images:
	$(foreach v,$(IMAGE_SETTINGS),$(if $($(v)),$(v)='$($(v))')) hack/build-images.sh
