# Ansible checks (helper "ansible"): ansible-lint with the production profile and
# yamllint over the whole repository; both must print nothing but a pass.
ANSIBLE_ENV := PATH="$(CURDIR)/$(VENV)/bin:$$PATH" ANSIBLE_HOME="$(CURDIR)/.cache/ansible"

.PHONY: lint-ansible test-ansible test-system test-rolling

lint-ansible: setup
	$(ANSIBLE_ENV) $(VENV)/bin/ansible-lint --nocolor -q
	$(ANSIBLE_ENV) $(VENV)/bin/yamllint --strict .

# Fast Ansible checks: argument specs, preflight failures (changes nothing).
test-ansible: setup
	$(ANSIBLE_ENV) $(VENV)/bin/pytest -q tests/ansible

# Boots a Debian 12 container and provisions it with site.yml (several minutes).
test-system: setup
	$(ANSIBLE_ENV) $(VENV)/bin/pytest -q tests/system

# The two-host module alone (`make test` runs it too): a gateway over two booted inference
# hosts, a gateway-only host, then playbooks/rolling.yml over them under load (no change,
# a broken change, a good one, none again), its counts printed. About 25 minutes on 2
# cores, the first host's converge included.
test-rolling: setup
	$(ANSIBLE_ENV) $(VENV)/bin/pytest -q -s -rs tests/system/test_gateway_two_hosts.py
