# OpenBLAS, choosing among Debian's builds by OpenBLAS_FLAVOR:
#   openmp   /usr/lib/<multiarch>/openblas-openmp/   (libopenblas-openmp-dev)
#   pthread  /usr/lib/<multiarch>/openblas-pthread/  (libopenblas-pthread-dev)
#   system   whatever `pkg-config openblas` names (on Debian, the build that
#            update-alternatives currently selects), else libopenblas on the
#            default search path.
# Both builds carry the same soname, libopenblas.so.0, and the generic
# /usr/lib/<multiarch>/libopenblas.so.0 is an alternatives link, usually to
# pthread. So openmp and pthread are linked by full path in their own folder,
# which CMake turns into an RPATH: the programs load the flavour they were
# built for, whichever alternative is selected.
# Defines OpenBLAS::OpenBLAS, OpenBLAS_LIBRARY and OpenBLAS_INCLUDE_DIR.

if(NOT OpenBLAS_FLAVOR)
  set(OpenBLAS_FLAVOR system)
endif()
if(NOT OpenBLAS_FLAVOR MATCHES "^(openmp|pthread|system)$")
  message(FATAL_ERROR "OpenBLAS flavour '${OpenBLAS_FLAVOR}': expected openmp, pthread or system")
endif()

# The cached paths belong to one flavour; forget them when it changes.
if(DEFINED _OpenBLAS_CACHED_FLAVOR AND NOT _OpenBLAS_CACHED_FLAVOR STREQUAL OpenBLAS_FLAVOR)
  unset(OpenBLAS_LIBRARY CACHE)
  unset(OpenBLAS_INCLUDE_DIR CACHE)
endif()
set(_OpenBLAS_CACHED_FLAVOR "${OpenBLAS_FLAVOR}" CACHE INTERNAL "")

if(OpenBLAS_FLAVOR STREQUAL "system")
  set(_openblas_package libopenblas-dev)
  find_package(PkgConfig QUIET)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(PC_OpenBLAS QUIET openblas)
  endif()
  find_library(OpenBLAS_LIBRARY openblas HINTS ${PC_OpenBLAS_LIBRARY_DIRS})
  find_path(OpenBLAS_INCLUDE_DIR cblas.h
    HINTS ${PC_OpenBLAS_INCLUDE_DIRS} PATH_SUFFIXES openblas)
else()
  set(_openblas_package libopenblas-${OpenBLAS_FLAVOR}-dev)
  set(_openblas_lib_dir /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-${OpenBLAS_FLAVOR})
  set(_openblas_inc_dir /usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-${OpenBLAS_FLAVOR})
  find_library(OpenBLAS_LIBRARY openblas PATHS ${_openblas_lib_dir} NO_DEFAULT_PATH)
  # The flavour's own headers first; the generic cblas.h declares the same API.
  find_path(OpenBLAS_INCLUDE_DIR cblas.h PATHS ${_openblas_inc_dir} NO_DEFAULT_PATH)
  find_path(OpenBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas)
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(OpenBLAS
  REQUIRED_VARS OpenBLAS_LIBRARY OpenBLAS_INCLUDE_DIR
  REASON_FAILURE_MESSAGE "flavour ${OpenBLAS_FLAVOR}: apt-get install ${_openblas_package}")

if(OpenBLAS_FOUND AND NOT TARGET OpenBLAS::OpenBLAS)
  add_library(OpenBLAS::OpenBLAS UNKNOWN IMPORTED)
  set_target_properties(OpenBLAS::OpenBLAS PROPERTIES
    IMPORTED_LOCATION "${OpenBLAS_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${OpenBLAS_INCLUDE_DIR}")
endif()
mark_as_advanced(OpenBLAS_INCLUDE_DIR OpenBLAS_LIBRARY)
