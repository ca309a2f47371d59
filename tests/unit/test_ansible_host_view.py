# ruff: noqa: E501  (OUTPUT keeps the long lines Ansible printed)
"""host_view: one host's part of a multi-host ansible-playbook run, as a run on it alone prints it.

OUTPUT is real: serving.yml's preflight (--check, ansible-core 2.19, the repository's ansible.cfg)
on four hosts of one inventory, cut to a few tasks, trailing blanks dropped: case-a passes,
case-b fails in a loop (two items), case-c fails a task, case-d fails the argument spec.
"""

from __future__ import annotations

from tests.ansible._helpers import PlaybookRun, host_rc, host_view, parse_recap

OUTPUT = """\
PLAY [Check the inventory] *****************************************************

TASK [Assert the inventory has hosts in the groups inference, gateway or monitoring] ***
ok: [case-a]

PLAY [Serve LLMs with Triton and vLLM] *****************************************

TASK [Gathering Facts] *********************************************************
ok: [case-a]
ok: [case-c]
ok: [case-b]
ok: [case-d]

TASK [llmhost : Validating arguments against arg spec 'main' - Settings shared by the llmhost roles] ***
ok: [case-a]
ok: [case-b]
ok: [case-c]
[ERROR]: Task failed: Action failed: Validation of arguments failed:
argument 'triton_http_port' is of type str and we were unable to convert to int: "'eighty'" cannot be converted to an int
Origin: <unknown>

{'action': 'ansible.builtin.validate_argument_spec', 'args': {'argument_spec': {'llmhost_profile': {'type': 'str', [...]

task path: /work/main/playbooks/serving.yml:13
fatal: [case-d]: FAILED! =>
    argument_errors:
    - 'argument ''triton_http_port'' is of type str and we were unable to convert to int:
        "''eighty''" cannot be converted to an int'
    argument_spec_data:
        llmhost_allow_public_triton:
            default: false
            description:
            - Allow an I(llmhost_bind_address) other than loopback. Preflight refuses
                one without it, because Triton 2.51 has unauthenticated CVEs (CVE-2025-23310,
                -23311, -23317, -23319, -23320, -23334; fixed in Triton 25.07). Set it
                only when untrusted clients cannot reach the port.
            type: bool
        llmhost_bind_address:
            default: 127.0.0.1

TASK [llmhost : Assert the install paths are absolute] *************************
ok: [case-a] => (item=llmhost_prefix)
ok: [case-a] => (item=llmhost_venv_dir)
ok: [case-b] => (item=llmhost_prefix)
ok: [case-a] => (item=llmhost_triton_dir)
ok: [case-b] => (item=llmhost_venv_dir)
ok: [case-a] => (item=llmhost_model_repository_dir)
ok: [case-b] => (item=llmhost_triton_dir)
ok: [case-b] => (item=llmhost_model_repository_dir)
ok: [case-c] => (item=llmhost_prefix)
ok: [case-c] => (item=llmhost_venv_dir)
ok: [case-c] => (item=llmhost_triton_dir)
ok: [case-c] => (item=llmhost_model_repository_dir)

TASK [llmhost : Assert every model has a valid, unique name] *******************
ok: [case-a] => (item=tiny)
ok: [case-a] => (item=embed)
[ERROR]: Task failed: Action failed: llmhost_models[0].name must be unique and match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$, got "m"
Origin: /work/main/roles/llmhost/tasks/preflight.yml:66:3

64     quiet: true
65
66 - name: Assert every model has a valid, unique name
     ^ column 3

failed: [case-b] (item=m) =>
    _llmhost_index: 0
    ansible_index_var: _llmhost_index
    ansible_loop_var: item
    assertion: llmhost_models | selectattr('name', 'defined') | selectattr('name', 'equalto',
        item.name) | list | length == 1
    changed: false
    evaluated_to: false
    item:
        name: m
        source: tiny
    msg: llmhost_models[0].name must be unique and match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$,
        got "m"
[ERROR]: Task failed: Action failed: llmhost_models[1].name must be unique and match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$, got "m"
Origin: /work/main/roles/llmhost/tasks/preflight.yml:66:3

64     quiet: true
65
66 - name: Assert every model has a valid, unique name
     ^ column 3

failed: [case-b] (item=m) =>
    _llmhost_index: 1
    ansible_index_var: _llmhost_index
    ansible_loop_var: item
    assertion: llmhost_models | selectattr('name', 'defined') | selectattr('name', 'equalto',
        item.name) | list | length == 1
    changed: false
    evaluated_to: false
    item:
        name: m
        source: tiny
    msg: llmhost_models[1].name must be unique and match ^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$,
        got "m"
ok: [case-c] => (item=tiny)
ok: [case-c] => (item=embed)

TASK [llmhost : Assert every model has a known source with its fields] *********
ok: [case-a] => (item=tiny)
ok: [case-a] => (item=embed)
ok: [case-c] => (item=tiny)
ok: [case-c] => (item=embed)

TASK [llmhost : Assert url models carry a SHA-256] *****************************
skipping: [case-a] => (item=tiny)
skipping: [case-a] => (item=embed)
skipping: [case-a]
skipping: [case-c] => (item=tiny)
skipping: [case-c] => (item=embed)
skipping: [case-c]

TASK [python_env : Fail when profile gpu finds no NVIDIA driver] ***************
skipping: [case-a]
[ERROR]: Task failed: Action failed: llmhost_profile is gpu but no working NVIDIA driver was found on case-c: /nonexistent/nvidia-smi is not installed. Install the NVIDIA driver first, or set llmhost_profile to cpu on a host without a GPU.
Origin: /work/main/roles/python_env/tasks/preflight.yml:145:3

143   when: _python_env_gpu | bool
144
145 - name: Fail when profile gpu finds no NVIDIA driver
      ^ column 3

task path: /work/main/roles/python_env/tasks/preflight.yml:145
fatal: [case-c]: FAILED! =>
    changed: false
    msg: 'llmhost_profile is gpu but no working NVIDIA driver was found on case-c: /nonexistent/nvidia-smi
        is not installed. Install the NVIDIA driver first, or set llmhost_profile to cpu
        on a host without a GPU.'

TASK [python_env : Fail when no CUDA build of vLLM fits the driver] ************
skipping: [case-a]

TASK [model_repository : Look for the model templates on the controller] *******
ok: [case-a -> localhost] => (item=config.pbtxt.j2)
ok: [case-a -> localhost] => (item=model.json.j2)

PLAY [Gateways on hosts of their own] ******************************************
skipping: no hosts matched

PLAY RECAP *********************************************************************
case-a                     : ok=40   changed=0    unreachable=0    failed=0    skipped=46   rescued=0    ignored=0
case-b                     : ok=7    changed=0    unreachable=0    failed=1    skipped=0    rescued=0    ignored=0
case-c                     : ok=19   changed=0    unreachable=0    failed=1    skipped=5    rescued=0    ignored=0
case-d                     : ok=1    changed=0    unreachable=0    failed=1    skipped=0    rescued=0    ignored=0

[WARNING]: Could not match supplied host pattern, ignoring: gateway
"""


def view(host: str, rc: int = 2) -> PlaybookRun:
    text = host_view(OUTPUT, host)
    return PlaybookRun(host_rc(rc, text), text)


def test_each_host_sees_only_its_own_results_under_the_name_localhost() -> None:
    for host in ("case-a", "case-b", "case-c", "case-d"):
        run = view(host)
        assert "case-" not in run.output, run.output
        assert list(run.recap()) == ["localhost"]
    assert parse_recap(OUTPUT)["case-b"] == view("case-b").recap()["localhost"]


def test_a_passing_host_keeps_its_loops_skips_and_delegated_results() -> None:
    run = view("case-a")
    assert run.rc == 0
    assert run.recap()["localhost"]["failed"] == 0
    assert "ok: [localhost -> localhost] => (item=config.pbtxt.j2)" in run.output
    task = run.output.split("Assert url models carry a SHA-256]", 1)[1].split("TASK [", 1)[0]
    assert task.split("*\n", 1)[1].strip().splitlines() == [
        "skipping: [localhost] => (item=tiny)", "skipping: [localhost] => (item=embed)", "skipping: [localhost]"]
    assert "Fail when profile gpu finds no NVIDIA driver] ***" in run.output
    assert "[ERROR]" not in run.output and "fatal:" not in run.output and "failed:" not in run.output


def test_a_loop_failure_keeps_both_items_with_the_errors_printed_before_them() -> None:
    run = view("case-b")
    assert run.rc == 2
    failure = run.failure()
    assert failure.startswith("failed: [localhost] (item=m) => _llmhost_index: 0")
    for needle in ("llmhost_models[0].name must be unique", "llmhost_models[1].name must be unique",
                   "[ERROR]: Task failed: Action failed: llmhost_models[1].name", "66 - name: Assert every model"):
        assert needle in failure, needle
    assert run.output.count("failed: [localhost] (item=m)") == 2
    # Tasks it never reached, and the other hosts' items of the same task, are not shown.
    assert "Fail when profile gpu finds no NVIDIA driver" not in run.output
    assert "(item=tiny)" not in run.output.split("Assert every model has a valid, unique name]", 1)[1]


def test_the_host_name_in_messages_is_shown_as_localhost() -> None:
    run = view("case-c")
    assert run.rc == 2
    assert "no working NVIDIA driver was found on localhost: /nonexistent/nvidia-smi is not installed" in run.failure()
    assert "task path: /work/main/roles/python_env/tasks/preflight.yml:145" in run.output


def test_the_errors_before_a_result_go_to_that_host_only() -> None:
    run = view("case-d")
    assert run.failure().startswith("fatal: [localhost]: FAILED! => argument_errors: - 'argument 'triton_http_port'")
    assert "Validation of arguments failed" in run.output
    assert "Assert the install paths are absolute" not in run.output  # after its failure: no line of its own
    for host in ("case-a", "case-b", "case-c"):
        assert "triton_http_port" not in view(host).output, host


def test_lines_of_no_host_are_everyones() -> None:
    for host in ("case-a", "case-d"):
        text = view(host).output
        assert "PLAY [Gateways on hosts of their own] ***" in text and "skipping: no hosts matched" in text
        assert text.rstrip().endswith("[WARNING]: Could not match supplied host pattern, ignoring: gateway")


def test_included_files_name_the_host_when_it_is_among_them() -> None:
    output = ("TASK [x : Include] ***\nincluded: /r/x.yml for h-1, h-2\n\nTASK [x : Assert] ***\nok: [h-2]\n\n"
              "PLAY RECAP ***\nh-1 : ok=1 changed=0 unreachable=0 failed=0\n"
              "h-2 : ok=2 changed=0 unreachable=0 failed=0\n")
    assert "included: /r/x.yml for localhost" in host_view(output, "h-1")
    assert "TASK [x : Assert]" not in host_view(output, "h-1")
    assert "ok: [localhost]" in host_view(output, "h-2")
    assert "h-2" not in host_view(output, "h-1")


def test_a_run_that_broke_before_the_recap_fails_every_host() -> None:
    text = host_view("ERROR! the playbook could not be parsed\n", "case-a")
    assert host_rc(1, text) == 1 and host_rc(0, text) == 1
    assert host_rc(2, host_view(OUTPUT, "case-a")) == 0
    assert host_rc(2, host_view(OUTPUT, "case-c")) == 2
