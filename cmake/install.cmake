# Installing and exporting: every non-testonly library with its headers, as the imported target
# dtrain::<its Bazel name> (dtrain::<package>_<name> where two packages use one name), so that
#   find_package(dtrain CONFIG REQUIRED)
#   target_link_libraries(app PRIVATE dtrain::zero_redundancy_optimizer)
# is all a consumer writes; dtrainConfig.cmake finds the same LibTorch and Abseil again.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS dtrain_torch dtrain_tensorpipe_agent EXPORT dtrainTargets)
set_target_properties(dtrain_torch PROPERTIES EXPORT_NAME torch)
set_target_properties(dtrain_tensorpipe_agent PROPERTIES EXPORT_NAME tensorpipe_agent)

# dtrain_install_library(TARGET NAME HEADERS): called by dtrain_cc_library.
function(dtrain_install_library target name hdrs)
  install(TARGETS ${target} EXPORT dtrainTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  foreach(h IN LISTS hdrs)
    if(h MATCHES "^${PROJECT_BINARY_DIR}/(.*)$" OR h MATCHES "^${PROJECT_SOURCE_DIR}/(.*)$")
      get_filename_component(dir "${CMAKE_MATCH_1}" DIRECTORY)
      install(FILES "${h}" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}/${dir}")
    endif()
  endforeach()
  set_property(GLOBAL APPEND PROPERTY DTRAIN_INSTALLED "${target}")
  set_property(GLOBAL APPEND PROPERTY DTRAIN_INSTALLED_NAMES "${name}")
  set_target_properties(${target} PROPERTIES DTRAIN_NAME "${name}")
endfunction()

# After every package: the export names (unique ones bare), the export set and the config files.
function(dtrain_finish_install)
  get_property(targets GLOBAL PROPERTY DTRAIN_INSTALLED)
  get_property(names GLOBAL PROPERTY DTRAIN_INSTALLED_NAMES)
  foreach(t IN LISTS targets)
    get_target_property(name ${t} DTRAIN_NAME)
    set(same "${names}")
    list(FILTER same INCLUDE REGEX "^${name}$")
    list(LENGTH same n)
    if(n GREATER 1)
      string(REGEX REPLACE "^dtrain_" "" name "${t}")
    endif()
    set_target_properties(${t} PROPERTIES EXPORT_NAME "${name}")
  endforeach()
  set(cmakedir "${CMAKE_INSTALL_LIBDIR}/cmake/dtrain")
  install(EXPORT dtrainTargets NAMESPACE dtrain:: DESTINATION "${cmakedir}")
  configure_package_config_file("${PROJECT_SOURCE_DIR}/cmake/dtrainConfig.cmake.in"
                                "${PROJECT_BINARY_DIR}/dtrainConfig.cmake" INSTALL_DESTINATION "${cmakedir}")
  write_basic_package_version_file("${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake"
                                   COMPATIBILITY SameMinorVersion)
  install(FILES "${PROJECT_BINARY_DIR}/dtrainConfig.cmake" "${PROJECT_BINARY_DIR}/dtrainConfigVersion.cmake"
          DESTINATION "${cmakedir}")
endfunction()
