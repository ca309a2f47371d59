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

# The two-host module alone, with the rolls of a change that `make test` leaves out (CI's
# budget): a gateway over two booted inference hosts, then playbooks/rolling.yml over them
# under load (a broken change, a good one, none), its counts printed. About 20-40 minutes
# on 2 cores.
test-rolling: setup
	LLMHOST_ROLLING_TEST=1 $(ANSIBLE_ENV) $(VENV)/bin/pytest -q -s -rs tests/system/test_gateway_two_hosts.py
