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

# The two-host module with the roll of playbooks/rolling.yml over two booted hosts under
# load (not in `make test`: about 12 minutes more on a 2-core machine).
test-rolling: setup
	LLMHOST_ROLLING_TEST=1 $(ANSIBLE_ENV) $(VENV)/bin/pytest -q -s tests/system/test_gateway_two_hosts.py
