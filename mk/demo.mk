# `make demo`: provision a freshly booted Debian 12 host (systemd-nspawn, see
# tests/harness, `python -m tests.harness`) with site.yml over SSH, as a real server, then
# smoke-test the Triton endpoint it serves (profile cpu, the tiny model).
# `make demo-down`: stop the host and remove everything it left.
#
# The host shares this machine's network: Triton listens on 127.0.0.1 at the
# DEMO_*_PORT ports below, sshd on 127.0.0.1:$(DEMO_SSH_PORT).

PYTHON ?= python3
DEMO_NAME ?= llmhost-demo
DEMO_SSH_PORT ?= 2222
DEMO_HTTP_PORT ?= 18000
DEMO_GRPC_PORT ?= 18001
DEMO_METRICS_PORT ?= 18002
DEMO_MODEL ?= tiny
# The embedding model beside it (inventory/demo.yml: the tiny model through vLLM's pooling runner).
DEMO_EMBED_MODEL ?= embed
DEMO_VARS ?= inventory/demo.yml
DEMO_PLAYBOOK ?= site.yml
DEMO_ANSIBLE_ARGS ?=
DEMO_STATE_BASE ?= .cache/testhost/hosts
DEMO_DIR := $(DEMO_STATE_BASE)/$(DEMO_NAME)
TESTHOST := $(PYTHON) -m tests.harness
DEMO_URL := http://127.0.0.1:$(DEMO_HTTP_PORT)
DEMO_PROMETHEUS_PORT ?= 19090
DEMO_NODE_EXPORTER_PORT ?= 19100
DEMO_GATEWAY_PORT ?= 18080
DEMO_GATEWAY_METRICS_PORT ?= 18081
# Triton's gRPC API through the gateway (tritonclient.grpc with the API key as metadata).
DEMO_GATEWAY_GRPC_PORT ?= 18082
# The gateway's API key: random, made once (0600), never committed; the play hashes it.
DEMO_GATEWAY_KEY_FILE ?= .cache/demo/gateway-api-key
DEMO_GATEWAY_URL := http://127.0.0.1:$(DEMO_GATEWAY_PORT)/v1
DEMO_PORT_VARS := {"triton_http_port": $(DEMO_HTTP_PORT), "triton_grpc_port": $(DEMO_GRPC_PORT), "triton_metrics_port": $(DEMO_METRICS_PORT), "prometheus_web_listen_address": "127.0.0.1:$(DEMO_PROMETHEUS_PORT)", "node_exporter_web_listen_address": "127.0.0.1:$(DEMO_NODE_EXPORTER_PORT)", "gateway_port": $(DEMO_GATEWAY_PORT), "gateway_metrics_port": $(DEMO_GATEWAY_METRICS_PORT), "gateway_grpc_port": $(DEMO_GATEWAY_GRPC_PORT), "gateway_demo_key_file": "$(abspath $(DEMO_GATEWAY_KEY_FILE))"}

.PHONY: demo demo-host demo-provision demo-smoke demo-check demo-down demo-gateway-key

demo: demo-smoke
	@echo
	@echo "llmhost demo is up: host $(DEMO_NAME) (Debian 12, systemd), models '$(DEMO_MODEL)' (chat, tools) and '$(DEMO_EMBED_MODEL)' (embeddings) on CPU"
	@echo "  HTTP     $(DEMO_URL)   (ready: $(DEMO_URL)/v2/health/ready)"
	@echo "  gRPC     127.0.0.1:$(DEMO_GRPC_PORT)"
	@echo "  metrics  http://127.0.0.1:$(DEMO_METRICS_PORT)/metrics"
	@echo "  prometheus http://127.0.0.1:$(DEMO_PROMETHEUS_PORT)   (alerts: /alerts, targets: /targets)"
	@echo "  OpenAI   $(DEMO_GATEWAY_URL)   (llmhost gateway; API key in $(DEMO_GATEWAY_KEY_FILE))"
	@echo "  gRPC     127.0.0.1:$(DEMO_GATEWAY_GRPC_PORT)   (Triton's gRPC API through the gateway; metadata authorization: Bearer <key>)"
	@echo "  grafana  not installed in the demo (no package source here); dashboards staged in the host under /var/lib/llmhost-monitoring/grafana"
	@echo "  ssh      ssh -i $$($(TESTHOST) status --name $(DEMO_NAME) --state $(DEMO_STATE_BASE) | $(PYTHON) -c 'import json,sys; print(json.load(sys.stdin)["ssh_key"])') -p $(DEMO_SSH_PORT) -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null root@127.0.0.1"
	@echo "  shell    $(TESTHOST) exec --state $(DEMO_STATE_BASE) --name $(DEMO_NAME) -- systemctl status tritonserver"
	@echo
	@echo "Try it:"
	@echo "  curl -s -X POST $(DEMO_URL)/v2/models/$(DEMO_MODEL)/generate \\"
	@echo "    -d '{\"text_input\": \"def fibonacci(n):\", \"max_tokens\": 32}'"
	@echo "  curl -sN -X POST $(DEMO_URL)/v2/models/$(DEMO_MODEL)/generate_stream \\"
	@echo "    -d '{\"text_input\": \"def fibonacci(n):\", \"max_tokens\": 32, \"stream\": true}'"
	@echo "  curl -s $(DEMO_GATEWAY_URL)/chat/completions -H \"Authorization: Bearer \$$(cat $(DEMO_GATEWAY_KEY_FILE))\" \\"
	@echo "    -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"$(DEMO_MODEL)\", \"messages\": [{\"role\": \"user\", \"content\": \"def fibonacci(n):\"}], \"max_tokens\": 32}'"
	@echo "  curl -s $(DEMO_GATEWAY_URL)/embeddings -H \"Authorization: Bearer \$$(cat $(DEMO_GATEWAY_KEY_FILE))\" \\"
	@echo "    -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"$(DEMO_EMBED_MODEL)\", \"input\": [\"def fibonacci(n):\", \"hello world\"], \"encoding_format\": \"float\"}'"
	@echo "  OpenAI clients: OPENAI_BASE_URL=$(DEMO_GATEWAY_URL) OPENAI_API_KEY=\$$(cat $(DEMO_GATEWAY_KEY_FILE))"
	@echo "    python -c 'import openai; print(openai.OpenAI().embeddings.create(model=\"$(DEMO_EMBED_MODEL)\", input=[\"a\", \"b\"]).data[1].embedding[:4])'"
	@echo
	@echo "Check what applications send (logprobs, tools, embeddings...): make demo-check"
	@echo "Stop it: make demo-down"

# Boot (or reuse) the host; its inventory and the pip variables land in $(DEMO_DIR).
demo-host:
	$(TESTHOST) rootfs
	$(TESTHOST) up --name $(DEMO_NAME) --ssh-port $(DEMO_SSH_PORT) --state $(DEMO_STATE_BASE) --pip-binds \
	  --group inference --group monitoring
	$(TESTHOST) pip-config --vars-file $(DEMO_DIR)/pip.yml >/dev/null

# Random, 43 characters, made only if absent, readable by its owner only.
demo-gateway-key:
	@test -s $(DEMO_GATEWAY_KEY_FILE) || { mkdir -p $(dir $(DEMO_GATEWAY_KEY_FILE)) && \
	  (umask 077 && $(PYTHON) -c 'import secrets; print(secrets.token_urlsafe(32))' > $(DEMO_GATEWAY_KEY_FILE)) && \
	  echo "demo: made the gateway's API key in $(DEMO_GATEWAY_KEY_FILE)"; }
	@chmod 0600 $(DEMO_GATEWAY_KEY_FILE)

demo-provision: setup demo-host demo-gateway-key
	@test -f $(DEMO_PLAYBOOK) || { echo "demo: $(DEMO_PLAYBOOK) is missing" >&2; exit 1; }
	@test -f $(DEMO_VARS) || { echo "demo: $(DEMO_VARS) is missing" >&2; exit 1; }
	$(VENV)/bin/ansible-playbook -i $(DEMO_DIR)/inventory.yml -e @$(DEMO_VARS) \
	  -e @$(DEMO_DIR)/pip.yml -e '$(DEMO_PORT_VARS)' $(DEMO_ANSIBLE_ARGS) $(DEMO_PLAYBOOK)

demo-smoke: demo-provision
	$(VENV)/bin/llmhost smoke --url $(DEMO_URL) --grpc-url 127.0.0.1:$(DEMO_GRPC_PORT) \
	  --metrics-url http://127.0.0.1:$(DEMO_METRICS_PORT) --model $(DEMO_MODEL)
	@# The OpenAI API through the gateway, with the official client, as the README shows it.
	$(PY) -c 'import openai, pathlib, sys; \
	  c = openai.OpenAI(base_url=sys.argv[1], api_key=pathlib.Path(sys.argv[2]).read_text().strip(), max_retries=0); \
	  r = c.completions.create(model=sys.argv[3], prompt="def fibonacci(n):", max_tokens=8); \
	  print("demo: the gateway at", sys.argv[1], "answered:", repr(r.choices[0].text))' \
	  $(DEMO_GATEWAY_URL) $(DEMO_GATEWAY_KEY_FILE) $(DEMO_MODEL)
	$(PY) -c 'import openai, pathlib, sys; \
	  c = openai.OpenAI(base_url=sys.argv[1], api_key=pathlib.Path(sys.argv[2]).read_text().strip(), max_retries=0); \
	  r = c.embeddings.create(model=sys.argv[3], input=["def fibonacci(n):", "hello world"]); \
	  print("demo: embeddings from", sys.argv[3] + ":", [len(d.embedding) for d in r.data], "floats each")' \
	  $(DEMO_GATEWAY_URL) $(DEMO_GATEWAY_KEY_FILE) $(DEMO_EMBED_MODEL)

# The OpenAI API as applications use it, against the running demo with the official
# client (tests/harness/openai_checks.py): logprobs, tools, structured output, token-id
# prompts, echo, n, seed, stop_token_ids, max_completion_tokens and embeddings.
demo-check:
	$(PY) -m tests.harness.openai_checks --base-url $(DEMO_GATEWAY_URL) --key-file $(DEMO_GATEWAY_KEY_FILE) \
	  --triton-url $(DEMO_URL) --model $(DEMO_MODEL) --embed-model $(DEMO_EMBED_MODEL)

demo-down:
	$(TESTHOST) down --name $(DEMO_NAME) --state $(DEMO_STATE_BASE)
