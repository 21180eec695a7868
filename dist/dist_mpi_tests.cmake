# The MPI tests, run by ctest through mpirun. Open MPI refuses to run as root
# and to start more ranks than cores unless told; CI runs as root on 2 cores.
add_executable(dist_mpi_test dist_mpi_test.cc)
target_include_directories(dist_mpi_test PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(dist_mpi_test PRIVATE fp8moe_mpi GTest::gtest)
add_executable(dist_fault_test dist_fault_test.cc)
target_include_directories(dist_fault_test PRIVATE ${PROJECT_SOURCE_DIR})
target_link_libraries(dist_fault_test PRIVATE fp8moe_mpi)

execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE _mpiexec_version
                ERROR_QUIET)
set(_flags ${MPIEXEC_PREFLAGS})
if(_mpiexec_version MATCHES "Open MPI|OpenRTE")
  list(APPEND _flags --oversubscribe)
endif()
# Cache (internal) so fp8moe_add_mpi_test sees them from any directory.
set(FP8MOE_MPIEXEC_FLAGS "${_flags}" CACHE INTERNAL "mpiexec flags of the MPI tests")
set(FP8MOE_MPI_TEST_ENV "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
    CACHE INTERNAL "environment of the MPI tests")

# fp8moe_add_mpi_test(NAME RANKS COMMAND...): COMMAND runs on RANKS ranks.
function(fp8moe_add_mpi_test name ranks)
  add_test(NAME ${name}
           COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${ranks} ${FP8MOE_MPIEXEC_FLAGS}
                   ${ARGN})
  # PROCESSORS 2: ctest -j2 runs an MPI job alone, never two at once.
  set_tests_properties(${name} PROPERTIES ENVIRONMENT "${FP8MOE_MPI_TEST_ENV}" TIMEOUT 300
                       PROCESSORS 2)
endfunction()

# Every test on 2 and 4 ranks; the ring-vs-MPI equality also on 1, 3, 5, 8.
foreach(ranks 2 4)
  fp8moe_add_mpi_test(dist_mpi_np${ranks} ${ranks} $<TARGET_FILE:dist_mpi_test>)
endforeach()
foreach(ranks 1 3 5 8)
  fp8moe_add_mpi_test(dist_mpi_ring_np${ranks} ${ranks} $<TARGET_FILE:dist_mpi_test>
                      --gtest_filter=RingVsMpi.*)
endforeach()

# Faults: a rank that dies or hangs ends the job on every rank, in bounded time.
foreach(mode abort exit hang)
  add_test(NAME dist_fault_${mode}
           COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/fault_test.sh ${mode}
                   $<TARGET_FILE:dist_fault_test> ${MPIEXEC_EXECUTABLE} ${FP8MOE_MPIEXEC_FLAGS})
  set_tests_properties(dist_fault_${mode} PROPERTIES ENVIRONMENT "${FP8MOE_MPI_TEST_ENV}"
                       TIMEOUT 120 PROCESSORS 2)
endforeach()
