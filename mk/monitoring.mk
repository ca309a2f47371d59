# Monitoring (issue 4): Prometheus rules and their unit tests, Grafana dashboards.
#   make monitoring-deps   install promtool/prometheus (Debian's prometheus package) if missing
#   make lint-monitoring   promtool check/test rules; dashboards match their builder
#   make dashboards        rebuild monitoring/grafana/dashboards/*.json from build_dashboards.py
#   make test-monitoring   the fast monitoring tests (tests/monitoring)
# tests/monitoring and tests/system/test_monitoring.py need /usr/bin/promtool,
# /usr/bin/prometheus and /usr/bin/prometheus-node-exporter; they install nothing themselves.

PROMTOOL ?= promtool
MONITORING_RULES := $(wildcard monitoring/prometheus/rules/*.yml)
MONITORING_RULE_TESTS := $(wildcard monitoring/prometheus/tests/*.yml)

.PHONY: monitoring-deps lint-monitoring dashboards test-monitoring

# Debian's prometheus package (2.42) brings promtool; its recommends are left out
# but node_exporter, which tests/monitoring/test_web_config.py runs for real, is
# installed by name. Where systemd runs, the packages start their services (stop
# them with: systemctl disable --now prometheus prometheus-node-exporter).
monitoring-deps:
	@command -v $(PROMTOOL) >/dev/null && test -x /usr/bin/prometheus && test -x /usr/bin/prometheus-node-exporter || { \
	  echo "installing Debian's prometheus and prometheus-node-exporter packages"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    prometheus prometheus-node-exporter; }

lint-monitoring: monitoring-deps setup
	$(PROMTOOL) check rules $(MONITORING_RULES)
	cd monitoring/prometheus/tests && $(PROMTOOL) test rules $(notdir $(MONITORING_RULE_TESTS))
	$(PY) monitoring/grafana/build_dashboards.py --check

dashboards: setup
	$(PY) monitoring/grafana/build_dashboards.py

test-monitoring: monitoring-deps setup
	$(VENV)/bin/pytest -q tests/monitoring
