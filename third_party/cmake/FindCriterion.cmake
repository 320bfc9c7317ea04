# Criterion, the unit-test framework (Debian: libcriterion-dev).
# Defines Criterion::criterion and Criterion_VERSION.

find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(PC_Criterion QUIET criterion)
endif()

find_path(Criterion_INCLUDE_DIR criterion/criterion.h HINTS ${PC_Criterion_INCLUDE_DIRS})
find_library(Criterion_LIBRARY criterion HINTS ${PC_Criterion_LIBRARY_DIRS})
set(Criterion_VERSION "${PC_Criterion_VERSION}")

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Criterion
  REQUIRED_VARS Criterion_LIBRARY Criterion_INCLUDE_DIR
  VERSION_VAR Criterion_VERSION
  REASON_FAILURE_MESSAGE "apt-get install libcriterion-dev")

if(Criterion_FOUND AND NOT TARGET Criterion::criterion)
  add_library(Criterion::criterion UNKNOWN IMPORTED)
  set_target_properties(Criterion::criterion PROPERTIES
    IMPORTED_LOCATION "${Criterion_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${Criterion_INCLUDE_DIR}")
endif()
mark_as_advanced(Criterion_INCLUDE_DIR Criterion_LIBRARY)
