"""The instructor's tools around grading: a term's late work, nbgrader's commands, the LMS, the students' download.

``term`` (submission times, due dates, extensions and late penalties, the nbgrader way), ``autograde``
(``nbgrader autograde`` and formgrader's button, routed through the sandbox), ``lms`` (grades into
Canvas or any LMS: ``python -m mha_lab export``), ``student_pack`` (the zip students get), ``classroom``
(a class of submissions that know their scores, for tests and benchmarks), ``grade_bench`` (grade such
a class and time it), ``release_values`` (the expected values the releases' visible tests compare with). Nothing here is course mathematics: students never import it, and the student
pack leaves it out.
"""
