"""The instructor's tools around grading: the term, nbgrader's commands, the LMS, reports, the students' download.

``course_folder`` (a course of its own: ``python -m mha_lab course init DIR``), ``grade`` (a class graded by
the engine, then the term, the grade sheet and the report: ``python -m mha_lab grade``), ``gradesheet`` (a grading
run's summary and ``grades_<a>.csv``), ``term`` (submission times, due dates, extensions and late penalties, the
nbgrader way; ``python -m mha_lab due`` sets a due date), ``autograde`` (``nbgrader autograde`` and formgrader's
button, routed through the sandbox), ``lms`` (grades into Canvas or any LMS: ``python -m mha_lab export``),
``report`` (the class report of an assignment: scores, per-cell statistics, misconceptions) and
``similarity`` (students' code alike, and alike the package's), ``spreadsheet`` (CSV cells no spreadsheet
runs as formulas, for every CSV written here), ``student_pack`` (the zip students get), ``stubs``
(the releases' task-naming stubs), ``release_values`` (the expected values the releases' visible tests
compare with), ``classroom`` (a class of submissions that know their scores, for tests and benchmarks),
``grade_bench`` (grade such a class and time it). Nothing here is course mathematics: students never
import it, and the student pack leaves it out.
"""
