# MHA Lab: `make book` builds the website, `make test` runs every test.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
A ?=

.PHONY: help book test assignments student-pack grade report bench serve lint clean

help:
	@echo "make book | test | assignments | student-pack | grade [A=<assignment>] | report A=<assignment> | bench | serve | lint | clean"

# (Re)create the virtual environment whenever requirements.txt changes. A first install takes minutes:
# pip names each package as it fetches and installs it (lines for requirements already met are left out).
# pip would compile the packages' bytecode one file at a time; compileall does it on every core (a few files that
# packages ship for newer Pythons fail there, as they do under pip: the status is not checked).
$(STAMP): requirements.txt pyproject.toml
	@echo "make: installing requirements.txt into $(VENV) (minutes the first time)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --no-compile --progress-bar on -r requirements.txt | { grep --line-buffered -v '^Requirement already satisfied' || true; }
	$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" > /dev/null || true
	touch $(STAMP)

# Chapters are MyST notebooks; their .ipynb twins (for Colab/Binder) are regenerated first, or only checked in CI.
# Execution is "cache" per _config.yml; with CI set, a copy of the config switches it to "force".
# Jupyter Book resolves local_extensions' paths from the config's folder, so the copy names them from the root.
# Each notebook's kernel warns that it talks to Jupyter over local TCP without encryption: that line, repeated
# once per chapter and nothing a reader can act on, is left out of the output.
book: $(STAMP) student-pack
	$(BIN)/python tests/test_book.py $${CI:+--check}
	mkdir -p _build
	config=_config.yml; \
	if [ -n "$${CI:-}" ]; then \
	  config=_build/_config.ci.yml; \
	  sed -e 's/^  execute_notebooks: cache /  execute_notebooks: force /' \
	      -e 's|^\(    [a-z_]*\): book/_ext|\1: $(CURDIR)/book/_ext|' _config.yml > $$config; \
	  grep -q '^  execute_notebooks: force ' $$config || { echo "could not switch execution to force" >&2; exit 1; }; \
	  grep -q ': $(CURDIR)/book/_ext' $$config || { echo "could not point local_extensions at book/_ext" >&2; exit 1; }; \
	fi; \
	$(BIN)/jupyter-book build . --config $$config 2>&1 | { grep --line-buffered -v 'Kernel is running over TCP without encryption' || true; }

# pytest spreads the tests over PYTEST_WORKERS processes (pytest-xdist; "auto": one per core, 0: none), while
# `make book` builds the site for its tests alongside (log: _build/book_build.log). The run ends with the ten
# slowest tests and the time per test file; each step here says how long it took.
PYTEST_WORKERS ?= auto
test: $(STAMP)
	@echo "make test: pytest -n $(PYTEST_WORKERS) over tests/ ($$(nproc) cores), make book alongside for the site's tests"
	start=$$SECONDS; status=0; $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS) || status=$$?; \
	echo "make test: pytest took $$((SECONDS - start)) s (exit $$status)"; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$status

# Releases in assignments/ from the sources in solutions/ (all of them, or A=<assignment>), with the
# expected values their visible tests compare with (solutions/<a>/expected.npz, copied into the release).
assignments: $(STAMP)
	$(BIN)/python -m mha_lab release-values $(A)
	for a in $(if $(A),$(A),$$(ls solutions)); do PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/nbgrader generate_assignment "$$a" --force; done

# The students' download, _build/student/mha_lab_student.zip: the releases, their expected values and
# assignments/requirements.txt; no package, no solutions or hidden checks. `make book` builds it first.
student-pack: $(STAMP)
	$(BIN)/python -m mha_lab student-pack

# Grade submitted/ (A=<assignment>, or every assignment with submissions), each submission in a
# sandbox; writes gradebook.db (with timestamps and late penalties: timestamp.txt, the due date,
# extensions.csv, nbgrader_config.py), feedback/, grades_<assignment>.csv and
# reports/<assignment>/ (the class report; make report A=... rebuilds it alone). E.g.
# GRADE_ARGS="--jobs 4".
# Grades into Canvas or another LMS: python -m mha_lab export --canvas <export>.csv --out <file>.
grade: $(STAMP)
	$(BIN)/python -m mha_lab grade $(A) --course . --jobs 2 $(GRADE_ARGS)

# The class report of a graded assignment, reports/<A>/ (index.html, report.md, similarity.csv), rebuilt from
# gradebook.db and autograded/ without grading again (make grade writes it too).
report: $(STAMP)
	test -n "$(A)" || { echo "make report A=<assignment>" >&2; exit 2; }
	$(BIN)/python -m mha_lab report $(A) --course .

bench: $(STAMP)
	$(BIN)/python -m mha_lab bench $(BENCH_ARGS)

serve: book
	$(BIN)/python -m http.server --bind 127.0.0.1 --directory _build/html 8000

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf _build autograded feedback gradebook.db reports
