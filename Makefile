# MHA Lab: `make book` builds the website, `make test` runs every test.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
A ?=

.PHONY: help book test assignments student-pack grade bench serve lint clean

help:
	@echo "make book | test | assignments | student-pack | grade [A=<assignment>] | bench | serve | lint | clean"

# (Re)create the virtual environment whenever requirements.txt changes.
$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	touch $(STAMP)

# Chapters are MyST notebooks; their .ipynb twins (for Colab/Binder) are regenerated first, or only checked in CI.
# Execution is "cache" per _config.yml; with CI set, a copy of the config switches it to "force".
# Jupyter Book resolves local_extensions' paths from the config's folder, so the copy names them from the root.
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
	$(BIN)/jupyter-book build . --config $$config

test: $(STAMP)
	status=0; $(BIN)/python -m pytest -q || status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$status

# Releases in assignments/ from the sources in solutions/ (all of them, or A=<assignment>).
assignments: $(STAMP)
	for a in $(if $(A),$(A),$$(ls solutions)); do PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/nbgrader generate_assignment "$$a" --force; done

# The students' download, _build/student/mha_lab_student.zip: the releases and the package they
# import, no solutions or hidden checks. `make book` builds it first: the grading chapter links it.
student-pack: $(STAMP)
	$(BIN)/python -m mha_lab student-pack

# Grade submitted/ (A=<assignment>, or every assignment with submissions), each submission in a
# sandbox; writes gradebook.db, feedback/ and grades_<assignment>.csv. E.g. GRADE_ARGS="--jobs 4".
grade: $(STAMP)
	$(BIN)/python -m mha_lab.grading $(A) --course . --jobs 2 $(GRADE_ARGS)

bench: $(STAMP)
	$(BIN)/python -m mha_lab bench $(BENCH_ARGS)

serve: book
	$(BIN)/python -m http.server --bind 127.0.0.1 --directory _build/html 8000

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf _build autograded feedback gradebook.db
