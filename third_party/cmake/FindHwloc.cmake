# hwloc 2.x, the hardware topology library (Debian: libhwloc-dev).
# Defines Hwloc::hwloc and Hwloc_VERSION.

find_package(PkgConfig QUIET)
if(PKG_CONFIG_FOUND)
  pkg_check_modules(PC_Hwloc QUIET hwloc)
endif()

find_path(Hwloc_INCLUDE_DIR hwloc.h HINTS ${PC_Hwloc_INCLUDE_DIRS})
find_library(Hwloc_LIBRARY hwloc HINTS ${PC_Hwloc_LIBRARY_DIRS})
set(Hwloc_VERSION "${PC_Hwloc_VERSION}")

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Hwloc
  REQUIRED_VARS Hwloc_LIBRARY Hwloc_INCLUDE_DIR
  VERSION_VAR Hwloc_VERSION
  REASON_FAILURE_MESSAGE "apt-get install libhwloc-dev hwloc")

if(Hwloc_FOUND AND NOT TARGET Hwloc::hwloc)
  add_library(Hwloc::hwloc UNKNOWN IMPORTED)
  set_target_properties(Hwloc::hwloc PROPERTIES
    IMPORTED_LOCATION "${Hwloc_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${Hwloc_INCLUDE_DIR}")
endif()
mark_as_advanced(Hwloc_INCLUDE_DIR Hwloc_LIBRARY)
